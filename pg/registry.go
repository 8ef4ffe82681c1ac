package pg

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gocomm/gocomm/shm"
	"github.com/gocomm/gocomm/wire"
)

// registry holds the shared-memory segments of one session: the host memory that descriptors
// point into.
//
// Invariants:
//  1. Every (segment, offset, length) a descriptor names is checked against the segment's
//     size before any byte is touched (resolve); nothing the client writes is trusted.
//  2. A segment is unmapped only when it was freed and no op holds a reference to it, so an
//     op that is still running can never touch unmapped memory.
type registry struct {
	dir string

	mu   sync.Mutex
	segs map[uint32]*segment
	next uint32
}

type segment struct {
	id    uint32
	mem   *shm.Segment
	refs  int
	freed bool
}

func newRegistry(dir string) *registry {
	return &registry{dir: dir, segs: map[uint32]*segment{}}
}

// alloc creates a segment of at least size bytes.
func (r *registry) alloc(size uint64) (id uint32, path string, bytes uint64, err error) {
	const page = 4096
	if size == 0 || size > 1<<40 {
		return 0, "", 0, fmt.Errorf("%w: segment of %d bytes", wire.ErrInvalid, size)
	}
	size = (size + page - 1) / page * page
	mem, err := shm.Create(r.dir, "gocomm-seg", int(size))
	if err != nil {
		return 0, "", 0, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.next++
	r.segs[r.next] = &segment{id: r.next, mem: mem}
	return r.next, mem.Path, size, nil
}

// free releases a segment once no op uses it (invariant 2).
func (r *registry) free(id uint32) error {
	r.mu.Lock()
	s := r.segs[id]
	if s == nil || s.freed {
		r.mu.Unlock()
		return fmt.Errorf("segment %d: %w", id, ErrNotFound)
	}
	s.freed = true
	unmap := s.refs == 0
	if unmap {
		delete(r.segs, id)
	}
	r.mu.Unlock()
	if unmap {
		return s.mem.Close()
	}
	return nil
}

// resolve returns the bytes each ref names, holding a reference on their segments until
// release is called (invariants 1 and 2).
func (r *registry) resolve(refs []wire.BufRef) (bufs [][]byte, release func(), err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	bufs = make([][]byte, len(refs))
	for i, ref := range refs {
		s := r.segs[ref.Segment]
		if s == nil || s.freed {
			return nil, nil, fmt.Errorf("%w: buffer %d: segment %d: %w", wire.ErrInvalid, i, ref.Segment, ErrNotFound)
		}
		size := uint64(len(s.mem.Data))
		if ref.Offset > size || ref.Length > size-ref.Offset {
			return nil, nil, fmt.Errorf("%w: buffer %d: bytes [%d, %d+%d) outside segment %d of %d bytes",
				wire.ErrInvalid, i, ref.Offset, ref.Offset, ref.Length, ref.Segment, size)
		}
		bufs[i] = s.mem.Data[ref.Offset : ref.Offset+ref.Length : ref.Offset+ref.Length]
	}
	held := make([]*segment, 0, len(refs))
	for _, ref := range refs {
		s := r.segs[ref.Segment]
		s.refs++
		held = append(held, s)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			var unmap []*segment
			r.mu.Lock()
			for _, s := range held {
				s.refs--
				if s.refs == 0 && s.freed {
					unmap = append(unmap, s)
					delete(r.segs, s.id)
				}
			}
			r.mu.Unlock()
			for _, s := range unmap {
				s.mem.Close()
			}
		})
	}
	return bufs, release, nil
}

// locate finds b inside one of the segments: the open file, its inode and b's offset.
func (r *registry) locate(b []byte) (fd int, ino, off uint64, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.segs {
		if off, ok := s.mem.Contains(b); ok && s.mem.File != nil {
			return int(s.mem.File.Fd()), s.mem.Ino, off, true
		}
	}
	return 0, 0, 0, false
}

// closeAll frees every segment; ones still referenced are unmapped by their last release.
func (r *registry) closeAll() error {
	r.mu.Lock()
	ids := make([]uint32, 0, len(r.segs))
	for id, s := range r.segs {
		if !s.freed {
			ids = append(ids, id)
		}
	}
	r.mu.Unlock()
	var errs []error
	for _, id := range ids {
		if err := r.free(id); err != nil && !errors.Is(err, ErrNotFound) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
