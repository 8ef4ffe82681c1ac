package wire

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func buf(n uint64) BufRef { return BufRef{Segment: 1, Offset: 0, Length: n} }

func TestDescRoundTrip(t *testing.T) {
	d := Desc{
		Seq: 7, Group: 3, Kind: OpAllToAll, DType: BFloat16, Device: DeviceHost, Root: -1, Tag: 42,
		Count: 9, TimeoutMS: 1500, StreamValue: 99, Bufs: []BufRef{{1, 64, 12}, {2, 0, 8}}, Splits: []int64{1, 5, 2, 2},
	}
	got, err := DecodeDesc(d.Encode())
	if err != nil {
		t.Fatal(err)
	}
	if got.Seq != d.Seq || got.Group != d.Group || got.Kind != d.Kind || got.DType != d.DType || got.Root != d.Root ||
		got.Tag != d.Tag || got.Count != d.Count || got.TimeoutMS != d.TimeoutMS || got.StreamValue != 99 || len(got.Bufs) != 2 ||
		got.Bufs[1] != d.Bufs[1] || len(got.Splits) != 4 || got.Splits[1] != 5 {
		t.Fatalf("round trip: got %+v, want %+v", got, d)
	}
}

func TestDecodeRejects(t *testing.T) {
	good := (&Desc{Seq: 5, Kind: OpAllReduce, DType: Float32, RedOp: Sum, Count: 1, Bufs: []BufRef{buf(4)}}).Encode()
	for _, tc := range []struct {
		desc string
		b    []byte
	}{
		{"empty", nil},
		{"shorter than the header", good[:40]},
		{"truncated buffer list", good[:len(good)-1]},
		{"trailing bytes", append(append([]byte(nil), good...), 0)},
		{"too many buffers", func() []byte { b := append([]byte(nil), good...); b[40] = 200; return b }()},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			d, err := DecodeDesc(tc.b)
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("DecodeDesc = %v, want ErrInvalid", err)
			}
			if len(tc.b) >= 8 && d.Seq != 5 {
				t.Fatalf("seq %d not recovered from a bad descriptor", d.Seq)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	const f32 = Float32
	for _, tc := range []struct {
		desc       string
		d          Desc
		rank, size int
		bad        string // substring of the error; "" means valid
	}{
		{"all_reduce", Desc{Kind: OpAllReduce, DType: f32, RedOp: Sum, Count: 3, Bufs: []BufRef{buf(12)}}, 0, 2, ""},
		{"all_reduce empty", Desc{Kind: OpAllReduce, DType: f32, RedOp: Sum, Count: 0, Bufs: []BufRef{buf(0)}}, 0, 2, ""},
		{"all_reduce short buffer", Desc{Kind: OpAllReduce, DType: f32, RedOp: Sum, Count: 3, Bufs: []BufRef{buf(8)}}, 0, 2, "holds 8 bytes, want 12"},
		{"all_reduce no op", Desc{Kind: OpAllReduce, DType: f32, Count: 3, Bufs: []BufRef{buf(12)}}, 0, 2, "invalid"},
		{"unknown reduce op", Desc{Kind: OpAllReduce, DType: f32, RedOp: 9, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, "unknown reduce op 9"},
		{"cuda op on a host segment", Desc{Kind: OpBroadcast, DType: f32, Device: DeviceCUDA, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, "not a segment of device 1"},
		{"host op on a cuda segment", Desc{Kind: OpBroadcast, DType: f32, Count: 1, Bufs: []BufRef{{Segment: CUDASegment | 3, Length: 4}}}, 0, 2, "not a segment of device 0"},
		{"cuda all_reduce", Desc{Kind: OpAllReduce, DType: f32, RedOp: Sum, Device: DeviceCUDA, Count: 1, StreamValue: 7, Bufs: []BufRef{{Segment: CUDASegment | 1, Length: 4}}}, 0, 2, ""},
		{"unknown device", Desc{Kind: OpBroadcast, DType: f32, Device: 5, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, "unknown device 5"},
		{"broadcast with a reduce op", Desc{Kind: OpBroadcast, DType: f32, RedOp: Sum, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, "does not reduce"},
		{"unknown dtype", Desc{Kind: OpBroadcast, DType: 99, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, "unknown dtype"},
		{"unknown kind", Desc{Kind: 77, DType: f32}, 0, 2, "unknown op kind"},
		{"broadcast root out of range", Desc{Kind: OpBroadcast, DType: f32, Root: 2, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, "root 2"},
		{"all_to_all_v", a2av(16, 48, 32, 64, 32, 4), 0, 4, ""},
		{"all_to_all_v on the host", func() Desc { d := a2av(16, 48, 32, 64, 32, 4); d.Device = DeviceHost; d.Bufs = nil; return d }(), 0, 4, "need CUDA"},
		{"all_to_all_v splits of the wrong size", a2av(16, 48, 16, 64, 32, 4), 0, 4, "buffer 1 holds 16 bytes, want 32"},
		{"all_to_all_v output not whole rows", a2av(16, 48, 32, 33, 32, 4), 0, 4, "not whole rows"},
		{"all_to_all_v rows of 0 bytes", a2av(0, 0, 32, 0, 32, 4), 0, 4, "rows of 0 bytes"},
		{"all_to_all_v status missing", func() Desc { d := a2av(16, 48, 32, 64, 32, 4); d.Bufs = d.Bufs[:4]; return d }(), 0, 4, "want 5"},
		{"all_gather", Desc{Kind: OpAllGather, DType: f32, Count: 2, Bufs: []BufRef{buf(8), buf(24)}}, 1, 3, ""},
		{"all_gather output short", Desc{Kind: OpAllGather, DType: f32, Count: 2, Bufs: []BufRef{buf(8), buf(16)}}, 1, 3, "want 24"},
		{"reduce_scatter", Desc{Kind: OpReduceScatter, DType: f32, RedOp: Max, Count: 2, Bufs: []BufRef{buf(24), buf(8)}}, 2, 3, ""},
		{"gather at root", Desc{Kind: OpGather, DType: f32, Root: 1, Count: 2, Bufs: []BufRef{buf(8), buf(16)}}, 1, 2, ""},
		{"gather elsewhere", Desc{Kind: OpGather, DType: f32, Root: 1, Count: 2, Bufs: []BufRef{buf(8)}}, 0, 2, ""},
		{"gather elsewhere with output", Desc{Kind: OpGather, DType: f32, Root: 1, Count: 2, Bufs: []BufRef{buf(8), buf(16)}}, 0, 2, "2 buffers, want 1"},
		{"scatter at root", Desc{Kind: OpScatter, DType: f32, Root: 0, Count: 1, Bufs: []BufRef{buf(4), buf(8)}}, 0, 2, ""},
		{"send", Desc{Kind: OpSend, DType: f32, Root: 1, Tag: 3, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, ""},
		{"send to self", Desc{Kind: OpSend, DType: f32, Root: 0, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, "this rank"},
		{"recv any", Desc{Kind: OpRecv, DType: f32, Root: -1, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, ""},
		{"recv peer -2", Desc{Kind: OpRecv, DType: f32, Root: -2, Count: 1, Bufs: []BufRef{buf(4)}}, 0, 2, "peer -2"},
		{"barrier", Desc{Kind: OpBarrier}, 0, 2, ""},
		{"barrier with a buffer", Desc{Kind: OpBarrier, Bufs: []BufRef{buf(0)}}, 0, 2, "1 buffers, want 0"},
		{"all_to_all", Desc{Kind: OpAllToAll, DType: f32, Bufs: []BufRef{buf(12), buf(8)}, Splits: []int64{1, 2, 1, 1}}, 0, 2, ""},
		{"all_to_all empty", Desc{Kind: OpAllToAll, DType: f32, Bufs: []BufRef{buf(0), buf(0)}, Splits: []int64{0, 0, 0, 0}}, 1, 2, ""},
		{"all_to_all split sum", Desc{Kind: OpAllToAll, DType: f32, Bufs: []BufRef{buf(12), buf(8)}, Splits: []int64{1, 1, 1, 1}}, 0, 2, "input splits add up to 8"},
		{"all_to_all negative", Desc{Kind: OpAllToAll, DType: f32, Bufs: []BufRef{buf(4), buf(4)}, Splits: []int64{2, -1, 1, 0}}, 0, 2, "is -1"},
		{"all_to_all self", Desc{Kind: OpAllToAll, DType: f32, Bufs: []BufRef{buf(8), buf(8)}, Splits: []int64{2, 0, 1, 1}}, 0, 2, "sends itself 2"},
		{"all_to_all split count", Desc{Kind: OpAllToAll, DType: f32, Bufs: []BufRef{buf(8), buf(8)}, Splits: []int64{2, 2}}, 0, 2, "2 splits, want 4"},
		{"splits on all_reduce", Desc{Kind: OpAllReduce, DType: f32, RedOp: Sum, Count: 1, Bufs: []BufRef{buf(4)}, Splits: []int64{1}}, 0, 2, "without splits"},
		{"count overflow", Desc{Kind: OpAllGather, DType: Float64, Count: 1 << 61, Bufs: []BufRef{buf(8), buf(16)}}, 0, 2, "too large"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			err := tc.d.Validate(tc.rank, tc.size)
			if tc.bad == "" {
				if err != nil {
					t.Fatalf("Validate = %v, want nil", err)
				}
				// What validates must also cross the wire: the decoder's structural limits
				// (buffer count) once refused all_to_all_v's five buffers.
				if _, err := DecodeDesc(tc.d.Encode()); err != nil {
					t.Fatalf("DecodeDesc(Encode()) = %v", err)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.bad) {
				t.Fatalf("Validate = %v, want ErrInvalid containing %q", err, tc.bad)
			}
		})
	}
}

// FuzzDesc: no byte string makes decoding or validation panic, and whatever validates
// keeps its promises (buffer lengths add up).
func FuzzDesc(f *testing.F) {
	f.Add((&Desc{Kind: OpAllReduce, DType: Float32, RedOp: Sum, Count: 1, Bufs: []BufRef{buf(4)}}).Encode())
	f.Add((&Desc{Kind: OpAllToAll, DType: Int8, Bufs: []BufRef{buf(3), buf(3)}, Splits: []int64{1, 2, 1, 2}}).Encode())
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := DecodeDesc(b)
		if err != nil {
			return
		}
		for _, size := range []int{1, 2, 3} {
			if d.Validate(0, size) == nil && d.Kind == OpAllToAll {
				var in uint64
				for _, s := range d.Splits[:size] {
					in += uint64(s) * uint64(d.DType.Size())
				}
				if in != d.Bufs[0].Length {
					t.Fatalf("validated all_to_all whose splits do not cover its input")
				}
			}
		}
	})
}

// a2av is an OpAllToAllV descriptor with rows of row bytes and buffers of these sizes.
func a2av(row, in, inSplits, out, outSplits, status uint64) Desc {
	cb := func(seg uint32, n uint64) BufRef { return BufRef{Segment: CUDASegment | seg, Length: n} }
	return Desc{Kind: OpAllToAllV, DType: Uint8, Device: DeviceCUDA, Count: row, StreamValue: 1,
		Bufs: []BufRef{cb(1, in), cb(2, inSplits), cb(3, out), cb(4, outSplits), cb(5, status)}}
}

// TestMillisClamps: a huge timeout stays huge, never wrapping into a short or negative one.
func TestMillisClamps(t *testing.T) {
	for _, ms := range []uint64{1 << 53, 1 << 63, ^uint64(0), uint64(MaxTimeout / time.Millisecond)} {
		if d := Millis(ms); d != MaxTimeout {
			t.Errorf("Millis(%d) = %v, want %v", ms, d, MaxTimeout)
		}
	}
	if d := Millis(1500); d != 1500*time.Millisecond {
		t.Errorf("Millis(1500) = %v", d)
	}
	if deadline := time.Now().Add(Millis(^uint64(0))); !deadline.After(time.Now().Add(50 * 365 * 24 * time.Hour)) {
		t.Errorf("a deadline of the longest timeout is %v", deadline)
	}
}
