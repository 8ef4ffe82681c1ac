// Package segment keeps the memory segments a client registered with its session, host
// (shared-memory files) or CUDA (IPC-mapped allocations), and bounds-checks every buffer a
// descriptor names against them: one table and one check for both kinds.
//
// Invariants:
//  1. Every (segment, offset, length) a descriptor names is checked against the segment's
//     size before any byte is touched (Resolve); nothing the client writes is trusted.
//  2. A segment is unmapped only when it was dropped and no op holds a reference to it, so
//     an op that is still running can never touch unmapped memory. The session resolves an
//     op's buffers when it reads the op from the submission ring, before the next record,
//     so a drop the client wrote after an op naming the segment waits for that op.
package segment

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gocomm/gocomm/wire"
)

// CheckExtent checks that a segment the client says is claimed bytes long, mapped at ptr,
// lies inside the allocation the driver reports (base, size): a client that claims more
// than it registered would otherwise have ops read and write past the allocation.
func CheckExtent(kind string, id uint32, claimed, ptr, base, size uint64) error {
	if ptr < base || ptr-base > size || claimed > size-(ptr-base) {
		return fmt.Errorf("%w: %s %d claims %d bytes at %#x, the allocation there is %d bytes at %#x",
			wire.ErrInvalid, kind, id, claimed, ptr, size, base)
	}
	return nil
}

// Mem is one mapped segment.
type Mem interface {
	// Size is the segment's length in bytes.
	Size() uint64
	// Close unmaps it; the table calls it once, when the segment is dropped and unused.
	Close() error
}

// Table holds one session's segments of one kind.
type Table[M Mem] struct {
	kind string // what errors call a segment: "segment", "CUDA segment"

	mu       sync.Mutex
	segs     map[uint32]*entry[M]
	unmapped uint64 // segments closed so far
	closed   bool   // DropAll or Take ran: the session ends, Add refuses
}

// Stats says what a table holds: what the client registered and did not drop, what is
// still mapped (dropped segments an op still holds included), and how many were unmapped.
type Stats struct {
	Live        int
	Mapped      int
	MappedBytes uint64
	Unmapped    uint64
}

type entry[M Mem] struct {
	id      uint32
	mem     M
	refs    int
	dropped bool
}

// New makes an empty table; kind names its segments in errors.
func New[M Mem](kind string) *Table[M] {
	return &Table[M]{kind: kind, segs: map[uint32]*entry[M]{}}
}

// Has reports whether id names a live segment.
func (t *Table[M]) Has(id uint32) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.segs[id]
	return e != nil && !e.dropped
}

// Add registers mem as segment id. Once the table was emptied for good (DropAll, Take) it
// refuses (wire.ErrNotFound), and the caller unmaps mem: a segment made while its session
// closed would otherwise stay mapped with nothing left to drop it.
func (t *Table[M]) Add(id uint32, mem M) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("%s %d: %w: its session is closing", t.kind, id, wire.ErrNotFound)
	}
	if _, dup := t.segs[id]; dup {
		return fmt.Errorf("%w: %s %d registered twice", wire.ErrInvalid, t.kind, id)
	}
	t.segs[id] = &entry[M]{id: id, mem: mem}
	return nil
}

// Drop releases segment id once no op uses it (invariant 2).
func (t *Table[M]) Drop(id uint32) error {
	t.mu.Lock()
	e := t.segs[id]
	if e == nil || e.dropped {
		t.mu.Unlock()
		return fmt.Errorf("%s %d: %w", t.kind, id, wire.ErrNotFound)
	}
	e.dropped = true
	unmap := e.refs == 0
	if unmap {
		delete(t.segs, id)
		t.unmapped++
	}
	t.mu.Unlock()
	if unmap {
		return e.mem.Close()
	}
	return nil
}

// Resolve bounds-checks each ref (invariant 1) and returns the segment each names, holding
// a reference on them until release is called (invariant 2). With skipEmpty, a ref of no
// bytes names nothing (its entry is M's zero value) and need not name a segment.
func (t *Table[M]) Resolve(refs []wire.BufRef, skipEmpty bool) (mems []M, release func(), err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	mems = make([]M, len(refs))
	held := make([]*entry[M], 0, len(refs))
	for i, r := range refs {
		if skipEmpty && r.Length == 0 {
			continue
		}
		e := t.segs[r.Segment]
		if e == nil || e.dropped {
			return nil, nil, fmt.Errorf("%w: buffer %d: %s %d is not registered: %w", wire.ErrInvalid, i, t.kind, r.Segment, wire.ErrNotFound)
		}
		size := e.mem.Size()
		if r.Offset > size || r.Length > size-r.Offset {
			return nil, nil, fmt.Errorf("%w: buffer %d: bytes [%d, %d+%d) outside %s %d of %d bytes",
				wire.ErrInvalid, i, r.Offset, r.Offset, r.Length, t.kind, r.Segment, size)
		}
		mems[i] = e.mem
		held = append(held, e)
	}
	for _, e := range held {
		e.refs++
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			var unmap []*entry[M]
			t.mu.Lock()
			for _, e := range held {
				e.refs--
				if e.refs == 0 && e.dropped {
					unmap = append(unmap, e)
					delete(t.segs, e.id)
					t.unmapped++
				}
			}
			t.mu.Unlock()
			for _, e := range unmap {
				e.mem.Close()
			}
		})
	}
	return mems, release, nil
}

// Stats counts the table's segments.
func (t *Table[M]) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := Stats{Mapped: len(t.segs), Unmapped: t.unmapped}
	for _, e := range t.segs {
		if !e.dropped {
			st.Live++
		}
		st.MappedBytes += e.mem.Size()
	}
	return st
}

// Find returns a mapped segment for which match holds (dropped ones still in use included).
func (t *Table[M]) Find(match func(M) bool) (M, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range t.segs {
		if match(e.mem) {
			return e.mem, true
		}
	}
	var zero M
	return zero, false
}

// DropAll drops every segment, and every later Add is refused; ones still referenced are
// unmapped by their last release.
func (t *Table[M]) DropAll() error {
	t.mu.Lock()
	t.closed = true
	ids := make([]uint32, 0, len(t.segs))
	for id, e := range t.segs {
		if !e.dropped {
			ids = append(ids, id)
		}
	}
	t.mu.Unlock()
	var errs []error
	for _, id := range ids {
		if err := t.Drop(id); err != nil && !errors.Is(err, wire.ErrNotFound) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Take empties the table and returns every segment, referenced or not, for the caller to
// unmap: the session's end, when no op runs any more.
func (t *Table[M]) Take() []M {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	all := make([]M, 0, len(t.segs))
	for _, e := range t.segs {
		all = append(all, e.mem)
	}
	t.segs = map[uint32]*entry[M]{}
	t.unmapped += uint64(len(all))
	return all
}
