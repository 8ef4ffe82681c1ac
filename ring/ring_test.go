package ring

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gocomm/gocomm/shm"
	"github.com/gocomm/gocomm/spin"
)

func newRing(t *testing.T, queue int) (mem []byte, sub, cmp *Queue) {
	t.Helper()
	seg, err := shm.Create(t.TempDir(), "ring-test", Size(queue))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { seg.Close() })
	if err := Format(seg.Data, queue); err != nil {
		t.Fatal(err)
	}
	sub, cmp, err = Open(seg.Data)
	if err != nil {
		t.Fatal(err)
	}
	return seg.Data, sub, cmp
}

func TestLayout(t *testing.T) {
	mem, sub, cmp := newRing(t, 5000)
	if len(sub.data) != 8192 || len(cmp.data) != 8192 {
		t.Fatalf("queues of %d and %d bytes, want 8192 (5000 rounded up)", len(sub.data), len(cmp.data))
	}
	if got := binary.LittleEndian.Uint64(mem); got != magic {
		t.Fatalf("magic %#x", got)
	}
	for _, tc := range []struct {
		desc   string
		break_ func(m []byte)
	}{
		{"no magic", func(m []byte) { m[0] = 0 }},
		{"wrong version", func(m []byte) { binary.LittleEndian.PutUint32(m[offVersion:], 9) }},
		{"queue past the end", func(m []byte) { binary.LittleEndian.PutUint64(m[offCmpLen:], 1<<30) }},
		{"size not a power of two", func(m []byte) { binary.LittleEndian.PutUint64(m[offSubLen:], 6000) }},
		{"queue inside the header", func(m []byte) { binary.LittleEndian.PutUint64(m[offSubOff:], 8) }},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			m := append([]byte(nil), mem...)
			tc.break_(m)
			if _, _, err := Open(m); !errors.Is(err, ErrLayout) {
				t.Fatalf("Open = %v, want ErrLayout", err)
			}
		})
	}
}

// TestRoundTrip pushes records of random sizes through a small queue so that it wraps many
// times, and checks every byte and the order.
func TestRoundTrip(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 1))
	_, sub, _ := newRing(t, 4096)
	p, c := NewProducer(sub), NewConsumer(sub)
	var want [][]byte
	for i := 0; i < 5000; i++ {
		n := rng.IntN(1000)
		b := make([]byte, n)
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		if err := p.TryWrite(16, uint16(i), b[:n/2], b[n/2:]); err != nil {
			if !errors.Is(err, ErrFull) {
				t.Fatal(err)
			}
			// drain and retry
			for len(want) > 0 {
				rec, ok, err := c.Next()
				if err != nil || !ok {
					t.Fatalf("seed %d: Next = %v %v with %d records outstanding", seed, ok, err, len(want))
				}
				if !bytes.Equal(rec.Payload, want[0]) || rec.Type != 16 {
					t.Fatalf("seed %d: record mismatch", seed)
				}
				want = want[1:]
				c.Release()
			}
			if err := p.TryWrite(16, uint16(i), b); err != nil {
				t.Fatalf("seed %d: write into an empty queue: %v", seed, err)
			}
		}
		want = append(want, b)
	}
	for _, w := range want {
		rec, ok, err := c.Next()
		if err != nil || !ok || !bytes.Equal(rec.Payload, w) {
			t.Fatalf("seed %d: tail record mismatch (%v %v)", seed, ok, err)
		}
	}
	if _, ok, _ := c.Next(); ok {
		t.Fatal("queue should be empty")
	}
}

func TestTooBig(t *testing.T) {
	_, sub, _ := newRing(t, 4096)
	if err := NewProducer(sub).TryWrite(16, 0, make([]byte, 1100)); !errors.Is(err, ErrTooBig) {
		t.Fatalf("TryWrite = %v, want ErrTooBig", err)
	}
}

// TestCorrupt: a producer that lies about lengths or counters marks the queue corrupt for
// good (the consumer never reads outside the queue).
func TestCorrupt(t *testing.T) {
	for _, tc := range []struct {
		desc    string
		corrupt func(q *Queue)
	}{
		{"record longer than published", func(q *Queue) { binary.LittleEndian.PutUint32(q.data, 100) }},
		{"record past the end", func(q *Queue) { binary.LittleEndian.PutUint32(q.data, uint32(len(q.data))) }},
		{"tail beyond the queue size", func(q *Queue) { *q.tail = uint64(len(q.data)) * 3 }},
		{"tail shorter than a header", func(q *Queue) { *q.tail = 4 }},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			_, sub, _ := newRing(t, 4096)
			p := NewProducer(sub)
			if err := p.TryWrite(16, 0, []byte("12345678")); err != nil {
				t.Fatal(err)
			}
			tc.corrupt(sub)
			c := NewConsumer(sub)
			_, _, err := c.Next()
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Next = %v, want ErrCorrupt", err)
			}
			if _, _, err := c.Next(); !errors.Is(err, ErrCorrupt) {
				t.Fatal("corrupt queue became usable again")
			}
		})
	}
}

// TestConcurrentWake runs a producer and a consumer that sleeps on the futex, with pauses
// so the consumer really sleeps; every record must arrive, in order, without lost wake-ups
// (the consumer waits with a long timeout, so a lost wake-up shows up as a slow test).
func TestConcurrentWake(t *testing.T) {
	_, sub, _ := newRing(t, 4096)
	const n = 2000
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		p := NewProducer(sub)
		for i := 0; i < n; i++ {
			var b [8]byte
			binary.LittleEndian.PutUint64(b[:], uint64(i))
			for p.TryWrite(16, 0, b[:]) != nil {
				time.Sleep(time.Microsecond)
			}
			if i%100 == 0 {
				time.Sleep(2 * time.Millisecond)
			}
		}
	}()
	c := NewConsumer(sub)
	start := time.Now()
	for i := 0; i < n; {
		rec, ok, err := c.Next()
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			c.Wait(0, 10*time.Second)
			continue
		}
		if got := binary.LittleEndian.Uint64(rec.Payload); got != uint64(i) {
			t.Fatalf("record %d carries %d", i, got)
		}
		c.Release()
		i++
	}
	wg.Wait()
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("took %v: wake-ups were lost", el)
	}
}

// A Nudge ends a consumer's futex sleep without a record; a Wait after it sleeps again. A
// futex wait may also end early (a signal, such as the runtime's preemption): the consumer
// waits again until it was nudged, as the sidecar's loop does, and no wait here is unbounded.
func TestNudge(t *testing.T) {
	_, sub, _ := newRing(t, 4096)
	c := NewConsumer(sub)
	for round := 0; round < 20; round++ {
		var nudged atomic.Bool
		woke := make(chan struct{}, 1)
		go func() {
			for !nudged.Load() {
				c.Wait(0, 10*time.Second)
			}
			woke <- struct{}{}
		}()
		for deadline := time.Now().Add(5 * time.Second); atomicWaiters(sub) == 0; {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: the consumer never slept", round)
			}
			time.Sleep(100 * time.Microsecond)
		}
		at := time.Now()
		nudged.Store(true)
		c.Nudge()
		select {
		case <-woke:
			if _, ok, err := c.Next(); ok || err != nil {
				t.Fatalf("a nudge left a record (%v)", err)
			}
			if d := time.Since(at); d > 5*time.Second {
				t.Fatalf("round %d: the nudge did not wake the consumer (%v)", round, d)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: the nudge did not wake the consumer", round)
		}
	}
}

func atomicWaiters(q *Queue) uint32 { return atomic.LoadUint32(q.waiters) }

// TestMarks: the mark words sit at offset 2048 of the header (the client reads them there,
// csrc/client/ring.h), apart from every queue word, and a file that is not a ring has none.
func TestMarks(t *testing.T) {
	if _, err := OpenMarks(make([]byte, headerSize)); !errors.Is(err, ErrLayout) {
		t.Fatalf("marks of an unformatted file: %v, want ErrLayout", err)
	}
	mem, sub, cmp := newRing(t, 4096)
	m, err := OpenMarks(mem)
	if err != nil {
		t.Fatal(err)
	}
	p := NewProducer(sub)
	if err := p.TryWrite(16, 0, []byte("op")); err != nil {
		t.Fatal(err)
	}
	m.Set(0, 7)
	m.Set(MarkWords-1, 0xdeadbeef)
	if got := binary.LittleEndian.Uint32(mem[2048:]); got != 7 {
		t.Fatalf("word 0 at offset 2048 holds %d, want 7", got)
	}
	if got := binary.LittleEndian.Uint32(mem[2048+4*(MarkWords-1):]); got != 0xdeadbeef || m.Get(MarkWords-1) != got {
		t.Fatalf("the last word holds %#x (Get %#x), want 0xdeadbeef", got, m.Get(MarkWords-1))
	}
	if 2048+4*MarkWords > headerSize {
		t.Fatalf("%d mark words run past the header", MarkWords)
	}
	rec, ok, err := NewConsumer(sub).Next()
	if err != nil || !ok || string(rec.Payload) != "op" {
		t.Fatalf("the queue after the marks were set: %+v %v %v", rec, ok, err)
	}
	if !NewConsumer(cmp).Empty() {
		t.Fatal("the completion queue is not empty")
	}
}

// TestWaitSpins: a spinning Wait returns as soon as a record is published, long before its
// spin ends; on an empty queue it spins for its spin, then sleeps for at most its timeout.
// Either way it leaves no spinner counted.
func TestWaitSpins(t *testing.T) {
	_, sub, _ := newRing(t, 4096)
	c := NewConsumer(sub)
	go func() {
		time.Sleep(2 * time.Millisecond)
		if err := NewProducer(sub).TryWrite(16, 0, []byte("op")); err != nil {
			t.Error(err)
		}
	}()
	start := time.Now()
	c.Wait(20*time.Second, 20*time.Second)
	if took := time.Since(start); took > 5*time.Second || c.Empty() {
		t.Fatalf("Wait returned after %v with the queue empty: %v", took, c.Empty())
	}
	if _, ok, err := c.Next(); !ok || err != nil {
		t.Fatalf("the record after Wait: %v %v", ok, err)
	}
	c.Release()
	start = time.Now()
	c.Wait(3*time.Millisecond, 30*time.Millisecond)
	if took := time.Since(start); took < 3*time.Millisecond || took > 5*time.Second {
		t.Fatalf("an empty queue's Wait(3ms spin, 30ms sleep) returned after %v", took)
	}
	if n := spin.Spinning(); n != 0 {
		t.Fatalf("%d spinners counted after the waits", n)
	}
}
