// Package wire holds what both sides of the sidecar's seams agree on: dtype and
// reduce-op codes, op kinds, and the op descriptor the client writes into its ring.
// Values are fixed by the protocol (csrc/client/wire.h mirrors them).
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// Ring record types of the gocomm protocol (the ring reserves types below 16).
const (
	// RecOp is an op descriptor, client to sidecar.
	RecOp uint16 = 16
	// RecDone is a completion, sidecar to client.
	RecDone uint16 = 17
	// RecIPC registers a CUDA allocation of the client, client to sidecar:
	//	0 u32 segment (client-chosen, CUDASegment bit set)   4 u32 reserved
	//	8 u64 size   16 [64]byte CUDA IPC handle of the allocation
	RecIPC uint16 = 18
	// RecIPCDrop says an allocation is gone: 0 u32 segment.
	RecIPCDrop uint16 = 19
	// RecGraphOp registers an op captured in a CUDA graph, client to sidecar (answered by a
	// RecDone of the descriptor's seq; docs/decisions/0020):
	//	0 u32 trigger index   4 u32 segment of the trigger page (host)   8 u64 its offset
	//	16 the op's descriptor, as in a RecOp
	RecGraphOp uint16 = 24
	// RecGraphDrop says the graph holding a trigger's op is gone: 0 u32 trigger index.
	RecGraphDrop uint16 = 25
)

// GraphOpHeader is the size of a RecGraphOp payload's fixed part, before its descriptor.
const GraphOpHeader = 16

// CUDASegment marks segment ids that name CUDA allocations (RecIPC); the others name host
// segments (AllocSegment).
const CUDASegment = 1 << 31

// OpKind is what an op descriptor asks for. Wire values are fixed (csrc/client/wire.h).
type OpKind uint8

const (
	OpAllReduce     OpKind = 1
	OpBroadcast     OpKind = 2
	OpReduce        OpKind = 3
	OpAllGather     OpKind = 4
	OpReduceScatter OpKind = 5
	OpAllToAll      OpKind = 6
	OpGather        OpKind = 7
	OpScatter       OpKind = 8
	OpSend          OpKind = 9
	OpRecv          OpKind = 10
	OpBarrier       OpKind = 11
	// OpAllToAllV moves rows by splits that live on the GPU (NVSHMEM path, CUDA only).
	OpAllToAllV OpKind = 12
)

var kindNames = map[OpKind]string{
	OpAllReduce: "all_reduce", OpBroadcast: "broadcast", OpReduce: "reduce",
	OpAllGather: "all_gather", OpReduceScatter: "reduce_scatter", OpAllToAll: "all_to_all",
	OpGather: "gather", OpScatter: "scatter", OpSend: "send", OpRecv: "recv", OpBarrier: "barrier",
	OpAllToAllV: "all_to_all_v",
}

func (k OpKind) String() string {
	if s, ok := kindNames[k]; ok {
		return s
	}
	return fmt.Sprintf("op(%d)", uint8(k))
}

// Collective reports whether every rank of the group takes part (and the op takes a place in
// the group's sequence).
func (k OpKind) Collective() bool { return k != OpSend && k != OpRecv }

// Device a descriptor's buffers live on.
const (
	DeviceHost uint8 = 0
	DeviceCUDA uint8 = 1
)

// Desc is a decoded op descriptor.
//
// Wire layout of a RecOp payload (little-endian):
//
//	 0 u64 seq         client's op id; echoed in the completion
//	 8 u32 group       handle from CreateGroup
//	12 u8  kind        OpKind
//	13 u8  dtype       DType
//	14 u8  redop       RedOp (0 when the op does not reduce)
//	15 u8  device      DeviceHost or DeviceCUDA
//	16 i32 root        root rank; peer rank for send/recv (-1: recv from any rank)
//	20 i32 tag         send/recv tag
//	24 u64 count       elements of this rank's unit (see Validate)
//	32 u64 timeout_ms  0: the group's timeout
//	40 u16 nbufs       buffer references that follow
//	42 u16 reserved
//	44 u32 nsplits     split entries that follow the buffers
//	48 u32 stream      CUDA ops: the value the client's stream writes to the group's ready
//	                   counter before the op (and the engine writes to done after it)
//	52 u32 reserved
//	56 nbufs x {u32 segment, u32 reserved, u64 offset, u64 length}
//	.. nsplits x i64   element counts
type Desc struct {
	Seq       uint64
	Group     uint32
	Kind      OpKind
	DType     DType
	RedOp     RedOp
	Device    uint8
	Root      int32
	Tag       int32
	Count     uint64
	TimeoutMS uint64
	// StreamValue orders a CUDA op against the client's stream (see DeviceSession.NewGroup).
	StreamValue uint32
	Bufs        []BufRef
	Splits      []int64
}

// BufRef names bytes inside a registered segment.
type BufRef struct {
	Segment uint32
	Offset  uint64
	Length  uint64
}

const (
	// DescHeader is the size of a descriptor without its buffers and splits.
	DescHeader = 56
	bufRefSize = 24
	maxBufs    = 8 // all_to_all_v has the most: 5 (pg/device_test.go sends 9)
	maxSplits  = 1 << 20
)

// Errors both sides of the sidecar's seams test for.
var (
	// ErrInvalid marks a descriptor the sidecar refuses.
	ErrInvalid = errors.New("invalid op descriptor")
	// ErrNotFound: a session, group or segment that does not exist (any more).
	ErrNotFound = errors.New("not found")
)

// DecodeDesc parses a RecOp payload. It checks the structure only; Validate checks meaning.
// When the payload holds at least a seq, the returned Desc carries it even on error, so the
// client's op can be failed.
func DecodeDesc(b []byte) (Desc, error) {
	le := binary.LittleEndian
	var d Desc
	if len(b) >= 8 {
		d.Seq = le.Uint64(b)
	}
	if len(b) < DescHeader {
		return d, fmt.Errorf("%w: %d bytes, the header alone is %d", ErrInvalid, len(b), DescHeader)
	}
	d.Group = le.Uint32(b[8:])
	d.Kind = OpKind(b[12])
	d.DType = DType(b[13])
	d.RedOp = RedOp(b[14])
	d.Device = b[15]
	d.Root = int32(le.Uint32(b[16:]))
	d.Tag = int32(le.Uint32(b[20:]))
	d.Count = le.Uint64(b[24:])
	d.TimeoutMS = le.Uint64(b[32:])
	nbufs := int(le.Uint16(b[40:]))
	nsplits := int(le.Uint32(b[44:]))
	d.StreamValue = le.Uint32(b[48:])
	if nbufs > maxBufs || nsplits > maxSplits {
		return d, fmt.Errorf("%w: %d buffers and %d splits", ErrInvalid, nbufs, nsplits)
	}
	if want := DescHeader + nbufs*bufRefSize + nsplits*8; len(b) != want {
		return d, fmt.Errorf("%w: %d bytes for %d buffers and %d splits, want %d", ErrInvalid, len(b), nbufs, nsplits, want)
	}
	at := DescHeader
	if nbufs > 0 { // sized once: each growth would be an allocation on every op's path
		d.Bufs = make([]BufRef, 0, nbufs)
	}
	if nsplits > 0 {
		d.Splits = make([]int64, 0, nsplits)
	}
	for i := 0; i < nbufs; i++ {
		d.Bufs = append(d.Bufs, BufRef{
			Segment: le.Uint32(b[at:]),
			Offset:  le.Uint64(b[at+8:]),
			Length:  le.Uint64(b[at+16:]),
		})
		at += bufRefSize
	}
	for i := 0; i < nsplits; i++ {
		d.Splits = append(d.Splits, int64(le.Uint64(b[at:])))
		at += 8
	}
	return d, nil
}

// Encode is DecodeDesc's inverse (tests, and Go clients).
func (d *Desc) Encode() []byte {
	le := binary.LittleEndian
	b := make([]byte, DescHeader+len(d.Bufs)*bufRefSize+len(d.Splits)*8)
	le.PutUint64(b, d.Seq)
	le.PutUint32(b[8:], d.Group)
	b[12], b[13], b[14], b[15] = uint8(d.Kind), uint8(d.DType), uint8(d.RedOp), d.Device
	le.PutUint32(b[16:], uint32(d.Root))
	le.PutUint32(b[20:], uint32(d.Tag))
	le.PutUint64(b[24:], d.Count)
	le.PutUint64(b[32:], d.TimeoutMS)
	le.PutUint16(b[40:], uint16(len(d.Bufs)))
	le.PutUint32(b[44:], uint32(len(d.Splits)))
	le.PutUint32(b[48:], d.StreamValue)
	at := DescHeader
	for _, r := range d.Bufs {
		le.PutUint32(b[at:], r.Segment)
		le.PutUint64(b[at+8:], r.Offset)
		le.PutUint64(b[at+16:], r.Length)
		at += bufRefSize
	}
	for _, s := range d.Splits {
		le.PutUint64(b[at:], uint64(s))
		at += 8
	}
	return b
}

// Validate checks that the descriptor makes sense for a member of rank rank in a group of
// size ranks: the kind, dtype and reduce op, the root, and that each buffer has exactly the
// length its role needs:
//
//	all_reduce, broadcast, reduce   bufs[0] in/out: count elements
//	all_gather, gather (root)       bufs[0] in: count; bufs[1] out: size*count (gather: root only)
//	reduce_scatter                  bufs[0] in: size*count; bufs[1] out: count
//	scatter                         bufs[0] out: count; bufs[1] in: size*count (root only)
//	all_to_all                      bufs[0] in, bufs[1] out; splits: size input counts, then
//	                                size output counts; each list sums to its buffer
//	send, recv                      bufs[0]: count elements; root is the peer (recv: -1 = any)
//	barrier                         no buffers
//
// Bounds of each buffer inside its segment are checked when the buffer is resolved; whether
// the reduce op suits the dtype depends on the engine (host: reduce.Check), and so does
// whether the device is served: the caller checks both.
func (d *Desc) Validate(rank, size int) error {
	if err := d.checkHeader(rank, size); err != nil {
		return err
	}
	return d.checkBufs(rank, size)
}

func (d *Desc) bad(format string, args ...any) error {
	return fmt.Errorf("%w: %s: "+format, append([]any{ErrInvalid, d.Kind}, args...)...)
}

// checkHeader checks the op's kind, device, dtype, reduce op and root or peer.
func (d *Desc) checkHeader(rank, size int) error {
	if _, ok := kindNames[d.Kind]; !ok {
		return fmt.Errorf("%w: unknown op kind %d", ErrInvalid, uint8(d.Kind))
	}
	if d.Device != DeviceHost && d.Device != DeviceCUDA {
		return d.bad("unknown device %d", d.Device)
	}
	for i, b := range d.Bufs {
		if (b.Segment&CUDASegment != 0) != (d.Device == DeviceCUDA) {
			return d.bad("buffer %d is in segment %#x, not a segment of device %d", i, b.Segment, d.Device)
		}
	}
	if d.Kind != OpBarrier && !d.DType.Valid() {
		return d.bad("unknown dtype %d", uint8(d.DType))
	}
	if d.Reduces() {
		if d.RedOp < Sum || d.RedOp > BXor {
			return d.bad("unknown reduce op %d", d.RedOp)
		}
	} else if d.RedOp != 0 {
		return d.bad("reduce op %d on an op that does not reduce", d.RedOp)
	}
	needsRoot := d.Kind == OpBroadcast || d.Kind == OpReduce || d.Kind == OpGather || d.Kind == OpScatter || d.Kind == OpSend
	if needsRoot && (d.Root < 0 || int(d.Root) >= size) {
		return d.bad("root %d in a group of %d", d.Root, size)
	}
	if d.Kind == OpRecv && (d.Root < -1 || int(d.Root) >= size) {
		return d.bad("peer %d in a group of %d", d.Root, size)
	}
	if (d.Kind == OpSend || d.Kind == OpRecv) && int(d.Root) == rank {
		return d.bad("peer %d is this rank", d.Root)
	}
	return nil
}

// checkBufs checks each buffer's length against the op's count, dtype and group size.
func (d *Desc) checkBufs(rank, size int) error {
	es := uint64(d.DType.Size())
	n := uint64(size)
	// unit is count elements in bytes; products are checked against overflow.
	if d.Count > (1<<62)/max(es, 1)/n {
		return d.bad("count %d is too large", d.Count)
	}
	unit := d.Count * es
	want := func(lens ...uint64) error {
		if len(d.Bufs) != len(lens) {
			return d.bad("%d buffers, want %d", len(d.Bufs), len(lens))
		}
		for i, l := range lens {
			if d.Bufs[i].Length != l {
				return d.bad("buffer %d holds %d bytes, want %d", i, d.Bufs[i].Length, l)
			}
		}
		return nil
	}
	if d.Kind != OpAllToAll && len(d.Splits) != 0 {
		return d.bad("%d splits on an op without splits", len(d.Splits))
	}
	root := int(d.Root) == rank
	switch d.Kind {
	case OpAllReduce, OpBroadcast, OpReduce, OpSend, OpRecv:
		return want(unit)
	case OpAllGather:
		return want(unit, n*unit)
	case OpGather:
		if root {
			return want(unit, n*unit)
		}
		return want(unit)
	case OpReduceScatter:
		return want(n*unit, unit)
	case OpScatter:
		if root {
			return want(unit, n*unit)
		}
		return want(unit)
	case OpBarrier:
		return want()
	case OpAllToAllV:
		return d.checkAllToAllV(n)
	case OpAllToAll:
		return d.checkAllToAll(rank, size, es)
	}
	return nil
}

// checkAllToAllV: input, in_splits (int64 per rank), output (its rows are the capacity),
// out_splits (int64 per rank), status (int32); Count is the bytes of one row.
func (d *Desc) checkAllToAllV(n uint64) error {
	if d.Device != DeviceCUDA {
		return d.bad("splits on the GPU need CUDA buffers")
	}
	if d.Count == 0 {
		return d.bad("rows of 0 bytes")
	}
	if len(d.Bufs) != 5 {
		return d.bad("%d buffers, want 5 (input, in_splits, output, out_splits, status)", len(d.Bufs))
	}
	for i, l := range map[int]uint64{1: 8 * n, 3: 8 * n, 4: 4} {
		if d.Bufs[i].Length != l {
			return d.bad("buffer %d holds %d bytes, want %d", i, d.Bufs[i].Length, l)
		}
	}
	for _, i := range []int{0, 2} {
		if d.Bufs[i].Length%d.Count != 0 {
			return d.bad("buffer %d holds %d bytes, not whole rows of %d", i, d.Bufs[i].Length, d.Count)
		}
	}
	return nil
}

// checkAllToAll: the splits are the input then the output counts per rank, and add up to
// the buffers' lengths.
func (d *Desc) checkAllToAll(rank, size int, es uint64) error {
	if len(d.Splits) != 2*size {
		return d.bad("%d splits, want %d (input then output counts)", len(d.Splits), 2*size)
	}
	if len(d.Bufs) != 2 {
		return d.bad("%d buffers, want 2", len(d.Bufs))
	}
	for half, name := range []string{"input", "output"} {
		var sum uint64
		for i, s := range d.Splits[half*size : (half+1)*size] {
			if s < 0 || uint64(s) > (1<<62)/max(es, 1) {
				return d.bad("%s split %d is %d", name, i, s)
			}
			sum += uint64(s) * es
			if sum > 1<<62 {
				return d.bad("%s splits overflow", name)
			}
		}
		if sum != d.Bufs[half].Length {
			return d.bad("%s splits add up to %d bytes, the buffer holds %d", name, sum, d.Bufs[half].Length)
		}
	}
	if d.Splits[rank] != d.Splits[size+rank] {
		return d.bad("rank %d sends itself %d elements but expects %d", rank, d.Splits[rank], d.Splits[size+rank])
	}
	return nil
}

// Reduces reports whether the op combines values with RedOp.
func (d *Desc) Reduces() bool {
	return d.Kind == OpAllReduce || d.Kind == OpReduce || d.Kind == OpReduceScatter
}

// Completion statuses, as the client sees them (csrc/client/wire.h mirrors them).
const (
	StatusOK          int32 = 0
	StatusInvalid     int32 = 1 // the descriptor was refused
	StatusUnsupported int32 = 2 // valid, but not served here (e.g. CUDA without a driver)
	StatusTimeout     int32 = 3 // the op's deadline passed
	StatusMismatch    int32 = 4 // ranks called different collectives
	StatusPeerLost    int32 = 5 // a peer's sidecar went away
	StatusAborted     int32 = 6 // the group was aborted (by a peer, a client or shutdown)
	StatusBroken      int32 = 7 // an earlier op broke the group
	StatusInternal    int32 = 8
)

// EncodeDone builds a RecDone payload:
//
//	0 u64 seq   8 i32 status   12 i32 source rank (recv from any rank; else -1)   16 message
func EncodeDone(seq uint64, status int32, source int32, msg string) []byte {
	b := make([]byte, 16+len(msg))
	le := binary.LittleEndian
	le.PutUint64(b, seq)
	le.PutUint32(b[8:], uint32(status))
	le.PutUint32(b[12:], uint32(source))
	copy(b[16:], msg)
	return b
}

// MaxTimeout is the longest timeout an op or group takes; a longer one (torch lets users
// pass timedelta.max) is clamped to it rather than overflowing time.Duration, which would
// wrap into a negative, immediate one.
const MaxTimeout = 100 * 365 * 24 * time.Hour

// Millis is a timeout given in milliseconds as a duration, clamped to MaxTimeout.
func Millis(ms uint64) time.Duration {
	if ms >= uint64(MaxTimeout/time.Millisecond) {
		return MaxTimeout
	}
	return time.Duration(ms) * time.Millisecond
}
