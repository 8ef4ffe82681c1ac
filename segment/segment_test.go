package segment

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/gocomm/gocomm/wire"
)

type fakeMem struct {
	size   uint64
	closed *int
}

func (m fakeMem) Size() uint64 { return m.size }
func (m fakeMem) Close() error { *m.closed++; return nil }

// TestBothKinds: host segments (every buffer names one) and CUDA segments (empty buffers
// name none) share one bounds-check and one lifetime rule.
func TestBothKinds(t *testing.T) {
	for _, kind := range []string{"segment", "CUDA segment"} {
		t.Run(kind, func(t *testing.T) {
			skipEmpty := kind == "CUDA segment"
			closed := 0
			tab := New[fakeMem](kind)
			if err := tab.Add(1, fakeMem{64, &closed}); err != nil {
				t.Fatal(err)
			}
			if err := tab.Add(1, fakeMem{64, &closed}); !errors.Is(err, wire.ErrInvalid) {
				t.Fatalf("second Add of one id: %v", err)
			}
			for _, c := range []struct {
				name string
				ref  wire.BufRef
				want string // "" when it resolves
			}{
				{"whole segment", wire.BufRef{Segment: 1, Length: 64}, ""},
				{"empty at the end", wire.BufRef{Segment: 1, Offset: 64}, ""},
				{"one past the end", wire.BufRef{Segment: 1, Offset: 1, Length: 64}, "outside " + kind},
				{"offset past the end", wire.BufRef{Segment: 1, Offset: 65, Length: 1}, "outside " + kind},
				{"wrapping length", wire.BufRef{Segment: 1, Offset: 8, Length: math.MaxUint64 - 4}, "outside " + kind},
				{"unknown segment", wire.BufRef{Segment: 2, Length: 1}, kind + " 2 is not registered"},
			} {
				_, release, err := tab.Resolve([]wire.BufRef{c.ref}, skipEmpty)
				if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
					t.Errorf("%s: %v, want %q", c.name, err, c.want)
				}
				if err == nil {
					release()
				}
			}
			_, _, err := tab.Resolve([]wire.BufRef{{Segment: 7}}, skipEmpty)
			if skipEmpty != (err == nil) {
				t.Errorf("empty buffer of no segment: %v", err)
			}

			// A dropped segment stays mapped while an op holds it.
			mems, release, err := tab.Resolve([]wire.BufRef{{Segment: 1, Length: 8}}, skipEmpty)
			if err != nil || mems[0].size != 64 {
				t.Fatal(mems, err)
			}
			if st := tab.Stats(); st != (Stats{Live: 1, Mapped: 1, MappedBytes: 64}) {
				t.Fatalf("stats before the drop: %+v", st)
			}
			if err := tab.Drop(1); err != nil || closed != 0 {
				t.Fatalf("drop while held: %v, closed %d", err, closed)
			}
			if st := tab.Stats(); st != (Stats{Live: 0, Mapped: 1, MappedBytes: 64}) {
				t.Fatalf("stats of a dropped segment an op holds: %+v", st)
			}
			if _, _, err := tab.Resolve([]wire.BufRef{{Segment: 1, Length: 8}}, skipEmpty); err == nil {
				t.Fatal("a dropped segment resolved")
			}
			release()
			release()
			if closed != 1 {
				t.Fatalf("closed %d times after the last release, want 1", closed)
			}
			if st := tab.Stats(); st != (Stats{Unmapped: 1}) {
				t.Fatalf("stats after the last release: %+v", st)
			}
			if err := tab.Drop(1); !errors.Is(err, wire.ErrNotFound) {
				t.Fatalf("second drop: %v", err)
			}
		})
	}
}

// TestCheckExtent: a CUDA registration may claim at most the allocation the driver reports
// from the mapped pointer on; claiming more, or a pointer outside it, is refused.
func TestCheckExtent(t *testing.T) {
	const base, size = 0x7f0000000000, 2 << 20
	for _, tc := range []struct {
		claimed, ptr uint64
		ok           bool
	}{
		{size, base, true},
		{size - 4096, base + 4096, true},
		{1, base + size - 1, true},
		{size + 1, base, false},           // more than the allocation
		{4097, base + size - 4096, false}, // runs past its end
		{1, base - 1, false},              // before it
		{0, base + size + 1, false},       // after it
		{^uint64(0), base + 4096, false},  // a wrapping claim
	} {
		err := CheckExtent("CUDA segment", 3, tc.claimed, tc.ptr, base, size)
		if (err == nil) != tc.ok {
			t.Errorf("claim %d at %#x: %v, want ok=%v", tc.claimed, tc.ptr, err, tc.ok)
		}
		if err != nil && !errors.Is(err, wire.ErrInvalid) {
			t.Errorf("claim %d at %#x: %v, want ErrInvalid", tc.claimed, tc.ptr, err)
		}
	}
}

// TestAddAfterTheEnd: once a table was emptied for good (DropAll, Take: the session ends),
// Add refuses, so the caller unmaps what it made instead of leaving it in a dead table.
func TestAddAfterTheEnd(t *testing.T) {
	for _, end := range []string{"DropAll", "Take"} {
		closed := 0
		tab := New[fakeMem]("segment")
		if err := tab.Add(1, fakeMem{64, &closed}); err != nil {
			t.Fatal(err)
		}
		if end == "DropAll" {
			tab.DropAll()
		} else {
			tab.Take()
		}
		if err := tab.Add(2, fakeMem{64, &closed}); !errors.Is(err, wire.ErrNotFound) || !strings.Contains(err.Error(), "closing") {
			t.Fatalf("%s: Add after it = %v, want ErrNotFound naming the close", end, err)
		}
		if st := tab.Stats(); st.Live != 0 || st.Mapped != 0 {
			t.Fatalf("%s: %+v", end, st)
		}
	}
}
