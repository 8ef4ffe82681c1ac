// Package ring is the data plane between a PyTorch process and its sidecar: two
// single-producer single-consumer queues of variable-size records in one shared-memory file.
// The client submits op descriptors on the submission queue; the sidecar answers on the
// completion queue. csrc/client/ring.{h,cc} is the client half of the same layout.
//
// File layout (integers little-endian, offsets in bytes):
//
//	   0  u64 magic "GOCOMMR1"       8  u32 version (1)
//	  16  u64 sub data offset        24  u64 sub data size (power of two)
//	  32  u64 cmp data offset        40  u64 cmp data size (power of two)
//	  64  sub head  (u64, written by the consumer only; own cache line)
//	 128  sub tail  (u64, written by the producer only)
//	 136  sub notify (u32 futex word, producer increments after each publish)
//	 140  sub waiters (u32, consumers about to sleep on notify)
//	 192  cmp head, 256 cmp tail, 264 cmp notify, 268 cmp waiters (same roles)
//	2048  marks: MarkWords u32 words the sidecar writes and the client only reads (Marks)
//	4096  sub data, then cmp data
//
// A record is an 8-byte header (u32 payload length, u16 type, u16 flags) and the payload,
// padded to a multiple of 8. Records never wrap: a producer that reaches the end of the data
// area writes a Pad record over the rest and starts again at offset 0.
//
// Invariants:
//  1. head and tail are byte counters that only grow; tail-head is the bytes in use and never
//     exceeds the data size. Each side writes only its own counter.
//  2. A record's bytes are written before the tail that covers them (x86 stores are ordered;
//     Go uses atomic stores), and read only after the tail was read.
//  3. A consumer that finds the queue empty reads notify, re-checks tail and only then sleeps
//     with FUTEX_WAIT(notify, value read). A producer increments notify after publishing, so
//     the kernel's compare in FUTEX_WAIT closes the window between the check and the sleep.
//     The Python producer always issues FUTEX_WAKE (it has no fences to order its notify store
//     against a load of waiters); the Go producer wakes only when waiters > 0, which is safe
//     because its increment is a locked instruction and the sleeping consumer entered the
//     kernel (serializing) before the compare.
//  4. The consumer trusts nothing in the file but the bytes of records up to tail: its head
//     is kept privately, and a record whose length runs past tail or past the end of the data
//     area marks the queue corrupt (ErrCorrupt) for good.
package ring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gocomm/gocomm/shm"
	spinpkg "github.com/gocomm/gocomm/spin"
)

// Record types. Types below 16 are the ring's own; the rest belong to the protocol on top.
const (
	TypePad uint16 = 0
)

const (
	magic      = 0x31524d4d4f434f47 // "GOCOMMR1" little-endian
	version    = 1
	headerSize = 4096
	recHeader  = 8

	offMagic, offVersion = 0, 8
	offSubOff, offSubLen = 16, 24
	offCmpOff, offCmpLen = 32, 40
	offSubHead           = 64
	offSubTail           = 128
	offCmpHead           = 192
	offCmpTail           = 256
	offMarks             = 2048
	notifyAfterTail      = 8
	waitersAfterTail     = 12
)

// Errors.
var (
	ErrFull    = errors.New("ring: queue full")
	ErrTooBig  = errors.New("ring: record larger than a quarter of the queue")
	ErrCorrupt = errors.New("ring: queue corrupt")
	ErrLayout  = errors.New("ring: bad file layout")
)

// Size returns the file size for two queues of queueBytes each (rounded up to a power of two
// of at least 4 KiB).
func Size(queueBytes int) int {
	q := roundPow2(queueBytes)
	return headerSize + 2*q
}

func roundPow2(n int) int {
	if n < 4096 {
		n = 4096
	}
	return 1 << bits.Len(uint(n-1))
}

// Format writes an empty layout with two queues of queueBytes each into mem, which must be at
// least Size(queueBytes) long and zeroed.
func Format(mem []byte, queueBytes int) error {
	q := roundPow2(queueBytes)
	if len(mem) < headerSize+2*q {
		return fmt.Errorf("%w: %d bytes for two %d-byte queues", ErrLayout, len(mem), q)
	}
	le := binary.LittleEndian
	le.PutUint32(mem[offVersion:], version)
	le.PutUint64(mem[offSubOff:], headerSize)
	le.PutUint64(mem[offSubLen:], uint64(q))
	le.PutUint64(mem[offCmpOff:], uint64(headerSize+q))
	le.PutUint64(mem[offCmpLen:], uint64(q))
	atomic.StoreUint64(u64(mem, offMagic), magic) // last: a reader that sees magic sees the rest
	return nil
}

// Queue is one direction of a ring file.
type Queue struct {
	head, tail      *uint64
	notify, waiters *uint32
	data            []byte
	mask            uint64
	hdr             []byte // the file's header page, for the record of a corruption
}

// checkHeader says whether mem starts with a formatted header of this version.
func checkHeader(mem []byte) error {
	if len(mem) < headerSize || atomic.LoadUint64(u64(mem, offMagic)) != magic {
		return fmt.Errorf("%w: no magic", ErrLayout)
	}
	if v := binary.LittleEndian.Uint32(mem[offVersion:]); v != version {
		return fmt.Errorf("%w: version %d, want %d", ErrLayout, v, version)
	}
	return nil
}

// Open returns the submission and completion queues of a formatted file.
func Open(mem []byte) (sub, cmp *Queue, err error) {
	if err := checkHeader(mem); err != nil {
		return nil, nil, err
	}
	le := binary.LittleEndian
	mk := func(offOff, offLen, offHead, offTail int) (*Queue, error) {
		off, n := le.Uint64(mem[offOff:]), le.Uint64(mem[offLen:])
		if n < 4096 || n&(n-1) != 0 || off < headerSize || off > uint64(len(mem)) || n > uint64(len(mem))-off {
			return nil, fmt.Errorf("%w: queue at %d size %d in %d bytes", ErrLayout, off, n, len(mem))
		}
		return &Queue{
			head:    u64(mem, offHead),
			tail:    u64(mem, offTail),
			notify:  u32(mem, offTail+notifyAfterTail),
			waiters: u32(mem, offTail+waitersAfterTail),
			data:    mem[off : off+n : off+n],
			mask:    n - 1,
			hdr:     mem[:headerSize:headerSize],
		}, nil
	}
	if sub, err = mk(offSubOff, offSubLen, offSubHead, offSubTail); err != nil {
		return nil, nil, err
	}
	if cmp, err = mk(offCmpOff, offCmpLen, offCmpHead, offCmpTail); err != nil {
		return nil, nil, err
	}
	return sub, cmp, nil
}

// headerWords lists the non-zero 32-bit words of the header's first 320 bytes as off=value.
func headerWords(h []byte) string {
	var b strings.Builder
	for off := 0; off+4 <= min(len(h), 320); off += 4 {
		if v := binary.LittleEndian.Uint32(h[off:]); v != 0 {
			fmt.Fprintf(&b, "%d=%#x ", off, v)
		}
	}
	return b.String()
}

// MarkWords is how many mark words the header holds (offset 2048, up to 3072).
const MarkWords = 256

// Marks are the header's mark words: a side channel from the sidecar to the client for facts
// the client must see before anything that follows them on the GPU. The protocol on top gives
// them their meaning (pg: word i is the handle of the last group whose streams on counter slot
// i were released). A store is a release store, and the client loads with acquire, so a client
// thread that saw an effect the sidecar caused after a store (a stream let go) sees the store.
type Marks struct{ mem []byte }

// OpenMarks returns the mark words of a formatted file.
func OpenMarks(mem []byte) (Marks, error) {
	if err := checkHeader(mem); err != nil {
		return Marks{}, err
	}
	return Marks{mem: mem[:headerSize:headerSize]}, nil
}

// Set stores v in word i (0 <= i < MarkWords).
func (m Marks) Set(i int, v uint32) { atomic.StoreUint32(u32(m.mem, offMarks+4*i), v) }

// Get loads word i.
func (m Marks) Get(i int) uint32 { return atomic.LoadUint32(u32(m.mem, offMarks+4*i)) }

func u64(mem []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }
func u32(mem []byte, off int) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }

func pad8(n int) int { return (n + 7) &^ 7 }

// Producer appends records to a queue. Not safe for concurrent use.
type Producer struct {
	q    *Queue
	tail uint64 // private copy: the producer is the only writer of tail
}

// NewProducer starts producing at the queue's current tail.
func NewProducer(q *Queue) *Producer {
	return &Producer{q: q, tail: atomic.LoadUint64(q.tail)}
}

// TryWrite appends one record whose payload is the concatenation of parts. It returns ErrFull
// when the consumer has not made room yet.
func (p *Producer) TryWrite(typ, flags uint16, parts ...[]byte) error {
	n := 0
	for _, b := range parts {
		n += len(b)
	}
	size := recHeader + pad8(n)
	if size > len(p.q.data)/4 {
		return fmt.Errorf("%w: %d bytes", ErrTooBig, n)
	}
	head := atomic.LoadUint64(p.q.head)
	off := int(p.tail & p.q.mask)
	padLen := 0
	if rest := len(p.q.data) - off; rest < size {
		padLen = rest
	}
	if uint64(len(p.q.data))-(p.tail-head) < uint64(padLen+size) {
		return ErrFull
	}
	le := binary.LittleEndian
	if padLen > 0 {
		le.PutUint32(p.q.data[off:], uint32(padLen-recHeader))
		le.PutUint16(p.q.data[off+4:], TypePad)
		le.PutUint16(p.q.data[off+6:], 0)
		off = 0
	}
	rec := p.q.data[off : off+size]
	le.PutUint32(rec, uint32(n))
	le.PutUint16(rec[4:], typ)
	le.PutUint16(rec[6:], flags)
	at := recHeader
	for _, b := range parts {
		at += copy(rec[at:], b)
	}
	p.tail += uint64(padLen + size)
	atomic.StoreUint64(p.q.tail, p.tail)
	atomic.AddUint32(p.q.notify, 1)
	if atomic.LoadUint32(p.q.waiters) > 0 {
		shm.Wake(p.q.notify, 1)
	}
	return nil
}

// Write is TryWrite that waits for room, polling every pause, until deadline (zero: no limit).
func (p *Producer) Write(deadline time.Time, pause time.Duration, typ, flags uint16, parts ...[]byte) error {
	for {
		err := p.TryWrite(typ, flags, parts...)
		if !errors.Is(err, ErrFull) {
			return err
		}
		if !deadline.IsZero() && time.Now().After(deadline) {
			return err
		}
		time.Sleep(pause)
	}
}

// Consumer reads records from a queue. Not safe for concurrent use.
type Consumer struct {
	q       *Queue
	head    uint64 // private copy; see invariant 4
	pending int    // bytes of the record handed out by Next, released by Release
	err     error
}

// NewConsumer starts consuming at the queue's current head.
func NewConsumer(q *Queue) *Consumer {
	return &Consumer{q: q, head: atomic.LoadUint64(q.head)}
}

// Record is one record handed out by Next. Payload aliases the shared memory and is valid
// until Release.
type Record struct {
	Type, Flags uint16
	Payload     []byte
}

// Next returns the next record, ok=false when the queue is empty, or ErrCorrupt (for good).
func (c *Consumer) Next() (rec Record, ok bool, err error) {
	if c.err != nil {
		return Record{}, false, c.err
	}
	if c.pending != 0 {
		c.Release()
	}
	le := binary.LittleEndian
	for {
		tail := atomic.LoadUint64(c.q.tail)
		avail := tail - c.head
		if avail == 0 {
			return Record{}, false, nil
		}
		if avail > uint64(len(c.q.data)) || avail < recHeader {
			// Keep what the header holds: whoever wrote over it left a pattern.
			return c.fail("tail %d head %d size %d; header words: %s", tail, c.head, len(c.q.data), headerWords(c.q.hdr))
		}
		off := int(c.head & c.q.mask)
		n := le.Uint32(c.q.data[off:])
		size := uint64(recHeader) + uint64(pad8(int(n)))
		if size > avail || off+int(size) > len(c.q.data) {
			return c.fail("record of %d bytes at %d with %d available", n, off, avail)
		}
		typ := le.Uint16(c.q.data[off+4:])
		if typ == TypePad {
			c.head += size
			atomic.StoreUint64(c.q.head, c.head)
			continue
		}
		c.pending = int(size)
		return Record{
			Type:    typ,
			Flags:   le.Uint16(c.q.data[off+6:]),
			Payload: c.q.data[off+recHeader : off+recHeader+int(n) : off+recHeader+int(n)],
		}, true, nil
	}
}

func (c *Consumer) fail(format string, args ...any) (Record, bool, error) {
	c.err = fmt.Errorf("%w: "+format, append([]any{ErrCorrupt}, args...)...)
	return Record{}, false, c.err
}

// Release frees the record returned by the last Next.
func (c *Consumer) Release() {
	if c.pending == 0 {
		return
	}
	c.head += uint64(c.pending)
	c.pending = 0
	atomic.StoreUint64(c.q.head, c.head)
}

// Empty reports whether no record is waiting.
func (c *Consumer) Empty() bool { return atomic.LoadUint64(c.q.tail) == c.head }

// Wait blocks until a record may be waiting: it spins for up to spin, then sleeps on the
// futex for at most timeout. It may return early; callers loop on Next.
func (c *Consumer) Wait(spin, timeout time.Duration) {
	if c.err != nil || !c.Empty() {
		return
	}
	// The spin holds its P unless spinners could crowd out the process's other goroutines
	// (package spin): a runtime.Gosched puts this goroutine on the global run queue and wakes
	// an idle thread to look for work, so yielding every few checks kept a second thread
	// waking and parking, and could move the goroutine to another CPU just before the record
	// came.
	if spin > 0 && spinpkg.For(spin, func() bool { return !c.Empty() }) {
		return
	}
	atomic.AddUint32(c.q.waiters, 1)
	n := atomic.LoadUint32(c.q.notify)
	if c.Empty() {
		shm.Wait(c.q.notify, n, timeout)
	}
	atomic.AddUint32(c.q.waiters, ^uint32(0))
}

// Nudge ends a Wait that sleeps on the futex, as a publish would, without a record: the
// consumer's loop finds nothing and waits again, spinning first. Safe from any goroutine.
func (c *Consumer) Nudge() {
	atomic.AddUint32(c.q.notify, 1)
	if atomic.LoadUint32(c.q.waiters) > 0 {
		shm.Wake(c.q.notify, 1)
	}
}
