// The NCCL calls: which dtypes and reductions map to NCCL's, and each op kind, collective
// or point-to-point, as the calls it makes.

package device

import (
	"errors"
	"fmt"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/cuda"
	"github.com/gocomm/gocomm/internal/nccl"
	"github.com/gocomm/gocomm/wire"
)

// ncclType maps a dtype (and op) to NCCL's; count is scaled for types NCCL sees as pairs.
func ncclType(dt wire.DType, op wire.RedOp) (nccl.DataType, nccl.RedOp, int, error) {
	var r nccl.RedOp
	switch op { // a switch, not a map literal: this runs on every reducing op's path to the GPU
	case wire.Sum:
		r = nccl.Sum
	case wire.Avg:
		r = nccl.Avg
	case wire.Product:
		r = nccl.Prod
	case wire.Min:
		r = nccl.Min
	case wire.Max:
		r = nccl.Max
	default:
		return 0, 0, 0, fmt.Errorf("%w: %s on CUDA tensors (NCCL has no bitwise reductions)", reduce.ErrUnsupported, op)
	}
	switch dt {
	case wire.Bool:
		// bool as uint8: or for sum/max, and for product/min
		if op == wire.Sum || op == wire.Max {
			return nccl.Uint8, nccl.Max, 1, nil
		}
		if op == wire.Product || op == wire.Min {
			return nccl.Uint8, nccl.Min, 1, nil
		}
	case wire.Uint8:
		return nccl.Uint8, r, 1, nil
	case wire.Int8:
		return nccl.Int8, r, 1, nil
	case wire.Int32:
		return nccl.Int32, r, 1, nil
	case wire.Uint32:
		return nccl.Uint32, r, 1, nil
	case wire.Int64:
		return nccl.Int64, r, 1, nil
	case wire.Uint64:
		return nccl.Uint64, r, 1, nil
	case wire.Float16:
		return nccl.Float16, r, 1, nil
	case wire.BFloat16:
		return nccl.BFloat16, r, 1, nil
	case wire.Float32:
		return nccl.Float32, r, 1, nil
	case wire.Float64:
		return nccl.Float64, r, 1, nil
	case wire.Float8E4M3FN:
		return nccl.Float8E4M3, r, 1, nil
	case wire.Float8E5M2:
		return nccl.Float8E5M2, r, 1, nil
	case wire.Complex64, wire.Complex128:
		if op == wire.Sum || op == wire.Avg {
			t := nccl.Float32
			if dt == wire.Complex128 {
				t = nccl.Float64
			}
			return t, r, 2, nil
		}
	}
	return 0, 0, 0, fmt.Errorf("%w: %s of %s on CUDA tensors", reduce.ErrUnsupported, op, dt)
}

// Check reports whether a reduction can run on CUDA tensors (what ncclType accepts).
func Check(dt wire.DType, op wire.RedOp) error {
	_, _, _, err := ncclType(dt, op)
	return err
}

// enqueueNCCL issues the NCCL calls of one op on stream st.
func enqueueNCCL(c nccl.Comm, op gpu.Op, st nccl.Stream, rank, size int, scratch cuda.Ptr) error {
	d := op.Desc
	p := op.Ptrs
	es := d.DType.Size()
	u := func(x uint64) uintptr { return uintptr(x) }
	switch d.Kind {
	case wire.OpAllReduce:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.AllReduce(u(p[0]), u(p[0]), int(d.Count)*k, t, r, st)
	case wire.OpReduce:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.Reduce(u(p[0]), u(p[0]), int(d.Count)*k, t, r, int(d.Root), st)
	case wire.OpReduceScatter:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.ReduceScatter(u(p[0]), u(p[1]), int(d.Count)*k, t, r, st)
	case wire.OpBroadcast:
		return c.Broadcast(u(p[0]), u(p[0]), int(d.Count)*es, nccl.Uint8, int(d.Root), st)
	case wire.OpAllGather:
		return c.AllGather(u(p[0]), u(p[1]), int(d.Count)*es, nccl.Uint8, st)
	case wire.OpBarrier:
		return c.AllReduce(uintptr(scratch), uintptr(scratch), 1, nccl.Float32, nccl.Sum, st)
	case wire.OpAllToAll:
		if m, ok := equalBlocks(d.Splits, size); ok && nccl.HasAllToAll() && !overlap(p[0], p[1], uint64(m*size*es)) {
			// NCCL's own all-to-all, as torch's NCCL backend calls it for equal splits: one
			// collective kernel instead of size send/recv pairs.
			return c.AllToAll(u(p[0]), u(p[1]), m*es, nccl.Uint8, st)
		}
		return grouped(func() error {
			var inOff, outOff uint64
			for j := 0; j < size; j++ {
				in, out := uint64(d.Splits[j])*uint64(es), uint64(d.Splits[size+j])*uint64(es)
				if err := c.Send(u(p[0]+inOff), int(in), nccl.Uint8, j, st); err != nil {
					return err
				}
				if err := c.Recv(u(p[1]+outOff), int(out), nccl.Uint8, j, st); err != nil {
					return err
				}
				inOff, outOff = inOff+in, outOff+out
			}
			return nil
		})
	case wire.OpGather:
		m := int(d.Count) * es
		return grouped(func() error {
			if err := c.Send(u(p[0]), m, nccl.Uint8, int(d.Root), st); err != nil {
				return err
			}
			if rank == int(d.Root) {
				for j := 0; j < size; j++ {
					if err := c.Recv(u(p[1])+uintptr(j*m), m, nccl.Uint8, j, st); err != nil {
						return err
					}
				}
			}
			return nil
		})
	case wire.OpScatter:
		m := int(d.Count) * es
		return grouped(func() error {
			if rank == int(d.Root) {
				for j := 0; j < size; j++ {
					if err := c.Send(u(p[1])+uintptr(j*m), m, nccl.Uint8, j, st); err != nil {
						return err
					}
				}
			}
			return c.Recv(u(p[0]), m, nccl.Uint8, int(d.Root), st)
		})
	}
	return fmt.Errorf("%w: %s on CUDA tensors", wire.ErrInvalid, d.Kind)
}

// equalBlocks says whether an all-to-all's splits (size input counts, then size output
// counts) are all the same m, and m.
func equalBlocks(splits []int64, size int) (int, bool) {
	if len(splits) != 2*size || size == 0 {
		return 0, false
	}
	for _, s := range splits {
		if s != splits[0] {
			return 0, false
		}
	}
	return int(splits[0]), true
}

// overlap says whether the n bytes at a and at b overlap.
func overlap(a, b, n uint64) bool { return n > 0 && a < b+n && b < a+n }

// grouped runs f between ncclGroupStart and ncclGroupEnd.
func grouped(f func() error) error {
	if err := nccl.GroupStart(); err != nil {
		return err
	}
	err := f()
	return errors.Join(err, nccl.GroupEnd())
}
