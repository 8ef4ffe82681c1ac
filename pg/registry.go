package pg

import (
	"fmt"
	"sync"

	"github.com/gocomm/gocomm/segment"
	"github.com/gocomm/gocomm/shm"
	"github.com/gocomm/gocomm/wire"
)

// registry holds the shared-memory segments of one session: the host memory that descriptors
// point into. The table (package segment) bounds-checks every buffer and keeps a segment
// mapped while an op uses it; registry makes and names the segments.
type registry struct {
	dir  string
	segs *segment.Table[hostSeg]

	mu   sync.Mutex
	next uint32
}

// hostSeg is one shared-memory segment.
type hostSeg struct{ *shm.Segment }

func (s hostSeg) Size() uint64 { return uint64(len(s.Data)) }

func newRegistry(dir string) *registry {
	return &registry{dir: dir, segs: segment.New[hostSeg]("segment")}
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
	r.next++
	id = r.next
	r.mu.Unlock()
	if err := r.segs.Add(id, hostSeg{mem}); err != nil {
		mem.Close()
		return 0, "", 0, err
	}
	return id, mem.Path, size, nil
}

// free releases a segment once no op uses it.
func (r *registry) free(id uint32) error { return r.segs.Drop(id) }

// resolve returns the bytes each ref names, holding a reference on their segments until
// release is called.
func (r *registry) resolve(refs []wire.BufRef) (bufs [][]byte, release func(), err error) {
	mems, release, err := r.segs.Resolve(refs, false)
	if err != nil {
		return nil, nil, err
	}
	bufs = make([][]byte, len(refs))
	for i, ref := range refs {
		bufs[i] = mems[i].Data[ref.Offset : ref.Offset+ref.Length : ref.Offset+ref.Length]
	}
	return bufs, release, nil
}

// locate finds b inside one of the segments: the open file, its inode and b's offset.
func (r *registry) locate(b []byte) (fd int, ino, off uint64, ok bool) {
	s, ok := r.segs.Find(func(s hostSeg) bool {
		o, in := s.Contains(b)
		off = o
		return in && s.File != nil
	})
	if !ok {
		return 0, 0, 0, false
	}
	return int(s.File.Fd()), s.Ino, off, true
}

// closeAll frees every segment; ones still referenced are unmapped by their last release.
func (r *registry) closeAll() error { return r.segs.DropAll() }
