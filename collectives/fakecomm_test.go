package collectives

// An in-memory transport for the collective tests: fcFabric connects n ranks of one collective
// running in one process (one goroutine per rank) and behaves like the real transport where
// it matters to the algorithms:
//
//   - Messages are matched by (source, destination, Tag). A message that arrives before its
//     receive is posted is kept and handed over with Sink.Take when the receive is posted; a
//     receive posted first gets its payload through Sink.Fill, from an io.Reader that returns
//     short reads, with a 256 KiB scratch buffer. Which of the two happens is random, per op
//     and per message (messages arrive at once or after a random delay).
//   - Each send goes one of three ways, like the real transport's: eager (copied at Send, the
//     request completes at once: a small message written to the socket), inline (read from the
//     sender's buffer when it arrives, by the receive's Fill or into an early message's copy;
//     the send completes then), or by reference (the receiver's Sink.Take reads the sender's
//     buffer itself, whenever its receive is posted, and the send completes on that "ack"; an
//     early message by reference holds the send open until its receive is posted, as the
//     transport's shared-memory path does). The fake never reads a sender's buffer after its
//     send completed, and it checks that the sender left the buffer untouched until then.
//   - A payload whose length differs from Sink.Len() fails the receive (and names both sizes).
//   - Request.Wait honours ctx cancellation.
//
// It also records protocol violations that the real transport would turn into hangs or
// corrupted data: a Tag sent (or a receive posted) twice for the same pair in one op, a message
// left unreceived or a receive left unmatched when every rank returned, a rank returning
// before one of its requests completed, a send to itself or to a rank outside the group, a
// panic in a rank or a sink.

import (
	"bytes"
	"context"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand"
	"os"
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fcScratchBytes is the scratch buffer the fake hands to Sink.Fill.
const fcScratchBytes = 256 << 10

var fcScratch = sync.Pool{New: func() any { b := make([]byte, fcScratchBytes); return &b }}

// Delivery paths taken, over the whole test binary (a test checks each can be taken).
var fcFills, fcTakes, fcRefTakes atomic.Int64

type fcKey struct {
	src, dst int
	tag      Tag
}

func (k fcKey) String() string {
	return fmt.Sprintf("%d->%d step %d slice %d", k.src, k.dst, k.tag.Step, k.tag.Slice)
}

// fcReq is a Request of the fake.
type fcReq struct {
	f    *fcFabric
	what string
	done chan struct{}
	err  error
}

func (f *fcFabric) newReq(what string) *fcReq {
	return &fcReq{f: f, what: what, done: make(chan struct{})}
}

func (q *fcReq) finish(err error) {
	q.err = err
	close(q.done)
	q.f.activity.Add(1)
}

func (q *fcReq) isDone() bool {
	select {
	case <-q.done:
		return true
	default:
		return false
	}
}

func (q *fcReq) Wait(ctx context.Context) error {
	select {
	case <-q.done:
		return q.err
	default:
	}
	f := q.f
	f.mu.Lock()
	f.waits[q]++
	f.mu.Unlock()
	f.blocked.Add(1)
	defer func() {
		f.blocked.Add(-1)
		f.mu.Lock()
		if f.waits[q]--; f.waits[q] == 0 {
			delete(f.waits, q)
		}
		f.mu.Unlock()
	}()
	select {
	case <-q.done:
		return q.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// How a message travels (see the top of the file).
type fcMode uint8

const (
	fcEager  fcMode = iota // data is the fake's own copy; the send has completed
	fcInline               // data is the sender's buffer until it is copied out
	fcRef                  // data is the sender's buffer until the receiver's Take returns
)

// fcMsg is a message on its way: sent, not yet received.
type fcMsg struct {
	key  fcKey
	mode fcMode
	data []byte
	snap []byte // inline and ref: a copy taken at Send, to catch a sender that writes too early
	sent *fcReq
}

// fcRecv is a posted receive that no message has matched yet.
type fcRecv struct {
	sink Sink
	req  *fcReq
}

type fcFabric struct {
	n int

	mu     sync.Mutex
	rng    *rand.Rand
	pLate  float64    // chance that a message arrives after a delay (its receive likely posted)
	modes  [3]float64 // weights of fcEager, fcInline, fcRef
	sends  map[fcKey]int
	recvs  map[fcKey]int
	early  map[fcKey][]*fcMsg  // arrived, waiting for their receive
	posted map[fcKey][]*fcRecv // posted, waiting for their message
	reqs   [][]*fcReq          // per rank, every request it created
	waits  map[*fcReq]int      // requests that ranks are waiting on
	bugs   []string

	busy     sync.WaitGroup // the fake's own goroutines (delayed arrivals, fills, takes)
	inflight atomic.Int32   // how many of them are running
	running  atomic.Int32   // ranks that have not returned
	blocked  atomic.Int32   // ranks inside Request.Wait
	activity atomic.Int64   // bumped by every call and completion, to see progress
}

// spawn runs fn on a goroutine of the fake (the transport's own threads).
func (f *fcFabric) spawn(fn func()) {
	f.busy.Add(1)
	f.inflight.Add(1)
	go func() {
		defer f.busy.Done()
		defer f.inflight.Add(-1)
		fn()
	}()
}

func newFcFabric(n int, seed int64) *fcFabric {
	rng := rand.New(rand.NewSource(seed))
	levels := []float64{0, 0.1, 0.5, 0.9, 1}
	return &fcFabric{
		n:      n,
		rng:    rng,
		pLate:  levels[rng.Intn(len(levels))],
		modes:  [][3]float64{{1, 0, 0}, {0, 1, 0}, {0, 0, 1}, {1, 1, 1}, {1, 2, 2}}[rng.Intn(5)],
		sends:  map[fcKey]int{},
		recvs:  map[fcKey]int{},
		early:  map[fcKey][]*fcMsg{},
		posted: map[fcKey][]*fcRecv{},
		reqs:   make([][]*fcReq, n),
		waits:  map[*fcReq]int{},
	}
}

func (f *fcFabric) bugf(format string, args ...any) {
	f.mu.Lock()
	f.bugs = append(f.bugs, fmt.Sprintf(format, args...))
	f.mu.Unlock()
}

// bugLocked records a violation; f.mu is held.
func (f *fcFabric) bugLocked(format string, args ...any) {
	f.bugs = append(f.bugs, fmt.Sprintf(format, args...))
}

// fcComm is one rank's Comm.
type fcComm struct {
	f    *fcFabric
	rank int
}

func (c *fcComm) Rank() int { return c.rank }
func (c *fcComm) Size() int { return c.f.n }

func (c *fcComm) Send(to int, t Tag, data []byte) Request {
	f := c.f
	k := fcKey{c.rank, to, t}
	f.activity.Add(1)
	q := f.newReq("send " + k.String())
	if to < 0 || to >= f.n || to == c.rank {
		f.bugf("send %v: no such peer in a group of %d", k, f.n)
		q.finish(fmt.Errorf("fake comm: send %v: no such peer", k))
		return q
	}
	f.mu.Lock()
	f.reqs[c.rank] = append(f.reqs[c.rank], q)
	if f.sends[k]++; f.sends[k] == 2 {
		f.bugLocked("tag sent twice in one op: %v", k)
	}
	mode := fcEager
	for x := f.rng.Float64() * (f.modes[0] + f.modes[1] + f.modes[2]); x >= f.modes[mode] && mode < fcRef; mode++ {
		x -= f.modes[mode]
	}
	late := f.rng.Float64() < f.pLate
	delay := f.rng.Intn(300)
	f.mu.Unlock()

	m := &fcMsg{key: k, sent: q, mode: mode}
	if mode == fcEager {
		m.data = bytes.Clone(data)
		q.finish(nil)
	} else {
		m.data, m.snap = data, bytes.Clone(data)
	}
	if !late {
		f.arrive(m)
		return q
	}
	f.spawn(func() {
		if delay < 150 {
			for range delay%4 + 1 {
				runtime.Gosched()
			}
		} else {
			time.Sleep(time.Duration(delay-150) * time.Microsecond)
		}
		f.arrive(m)
	})
	return q
}

// checkUntouched reports a send whose buffer changed before the send completed.
func (f *fcFabric) checkUntouched(m *fcMsg) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.checkUntouchedLocked(m)
}

func (f *fcFabric) checkUntouchedLocked(m *fcMsg) {
	if m.mode != fcEager && !bytes.Equal(m.data, m.snap) {
		f.bugLocked("the sender wrote into the buffer of %v (%d bytes) before the send completed", m.key, len(m.data))
	}
}

// arrive is the message reaching its destination: a posted receive gets it (on a goroutine of
// its own, as the transport's reader) through Fill, or through Take if it came by reference;
// else it is kept as an early message, inline ones copied off "the wire".
func (f *fcFabric) arrive(m *fcMsg) {
	f.mu.Lock()
	if rs := f.posted[m.key]; len(rs) > 0 {
		r := rs[0]
		if len(rs) == 1 {
			delete(f.posted, m.key)
		} else {
			f.posted[m.key] = rs[1:]
		}
		seed := f.rng.Int63()
		if m.mode == fcRef {
			f.spawn(func() { f.take(m, r.sink, r.req) })
		} else {
			f.spawn(func() { f.fill(m, r, seed) })
		}
		f.mu.Unlock()
		return
	}
	if m.mode == fcInline {
		f.checkUntouchedLocked(m)
		m.data, m.mode = bytes.Clone(m.data), fcEager
		m.sent.finish(nil)
	}
	f.early[m.key] = append(f.early[m.key], m)
	f.mu.Unlock()
}

func (f *fcFabric) lengthError(m *fcMsg, want int) error {
	return fmt.Errorf("fake comm: message %v has %d bytes, the receive expects %d", m.key, len(m.data), want)
}

func (f *fcFabric) fill(m *fcMsg, r *fcRecv, seed int64) {
	var err error
	defer func() {
		if p := recover(); p != nil {
			f.bugf("Sink.Fill of %v panicked: %v\n%s", m.key, p, debug.Stack())
			err = fmt.Errorf("fake comm: Fill panicked: %v", p)
		}
		if m.mode == fcInline {
			f.checkUntouched(m)
			m.sent.finish(nil)
		}
		r.req.finish(err)
	}()
	if want := r.sink.Len(); len(m.data) != want {
		err = f.lengthError(m, want)
		return
	}
	rd := &fcReader{b: m.data, rng: rand.New(rand.NewSource(seed))}
	sp := fcScratch.Get().(*[]byte)
	defer fcScratch.Put(sp)
	err = r.sink.Fill(rd, *sp)
	if err == nil && len(rd.b) > 0 {
		err = fmt.Errorf("fake comm: %v: Fill left %d of %d bytes unread", m.key, len(rd.b), len(m.data))
	}
	fcFills.Add(1)
}

func (f *fcFabric) take(m *fcMsg, s Sink, q *fcReq) {
	var err error
	defer func() {
		if p := recover(); p != nil {
			f.bugf("Sink.Take of %v panicked: %v\n%s", m.key, p, debug.Stack())
			err = fmt.Errorf("fake comm: Take panicked: %v", p)
		}
		if m.mode == fcRef { // the ack
			f.checkUntouched(m)
			m.sent.finish(nil)
		}
		q.finish(err)
	}()
	if want := s.Len(); len(m.data) != want {
		err = f.lengthError(m, want)
		return
	}
	err = s.Take(m.data)
	fcTakes.Add(1)
	if m.mode == fcRef {
		fcRefTakes.Add(1)
	}
}

func (c *fcComm) Recv(from int, t Tag, s Sink) Request {
	f := c.f
	k := fcKey{from, c.rank, t}
	f.activity.Add(1)
	q := f.newReq("recv " + k.String())
	if from < 0 || from >= f.n || from == c.rank {
		f.bugf("recv %v: no such peer in a group of %d", k, f.n)
		q.finish(fmt.Errorf("fake comm: recv %v: no such peer", k))
		return q
	}
	f.mu.Lock()
	f.reqs[c.rank] = append(f.reqs[c.rank], q)
	if f.recvs[k]++; f.recvs[k] == 2 {
		f.bugLocked("receive posted twice in one op: %v", k)
	}
	if ms := f.early[k]; len(ms) > 0 {
		m := ms[0]
		if len(ms) == 1 {
			delete(f.early, k)
		} else {
			f.early[k] = ms[1:]
		}
		async := f.rng.Intn(2) == 0
		f.mu.Unlock()
		if async {
			f.spawn(func() { f.take(m, s, q) })
		} else {
			f.take(m, s, q)
		}
		return q
	}
	f.posted[k] = append(f.posted[k], &fcRecv{sink: s, req: q})
	f.mu.Unlock()
	return q
}

// fcReader hands out a payload in reads of random length, as a socket does.
type fcReader struct {
	b   []byte
	rng *rand.Rand
}

func (r *fcReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	k := 1 + r.rng.Intn(96<<10)
	if r.rng.Intn(5) == 0 {
		k = 1 + r.rng.Intn(13)
	}
	k = min(k, len(p), len(r.b))
	copy(p, r.b[:k])
	r.b = r.b[k:]
	if len(r.b) == 0 && r.rng.Intn(2) == 0 {
		return k, io.EOF
	}
	return k, nil
}

// fcOutcome is what one op did on every rank.
type fcOutcome struct {
	errs []error  // per rank
	bugs []string // protocol violations
}

func (o fcOutcome) failed() bool {
	if len(o.bugs) > 0 {
		return true
	}
	for _, err := range o.errs {
		if err != nil {
			return true
		}
	}
	return false
}

func (o fcOutcome) String() string {
	var b strings.Builder
	for r, err := range o.errs {
		if err != nil {
			fmt.Fprintf(&b, "\n\trank %d: %v", r, err)
		}
	}
	for _, s := range o.bugs {
		fmt.Fprintf(&b, "\n\tviolation: %s", s)
	}
	return b.String()
}

// fcRun runs fn on every rank of a fresh fabric, each in its own goroutine, and reports
// what happened. ranks lists the ranks that take part (nil: all); the others never call.
func fcRun(n int, seed int64, timeout time.Duration, ranks []int, fn func(ctx context.Context, c Comm) error) fcOutcome {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return fcRunCtx(ctx, n, seed, ranks, fn)
}

func fcRunCtx(ctx context.Context, n int, seed int64, ranks []int, fn func(ctx context.Context, c Comm) error) fcOutcome {
	f := newFcFabric(n, seed)
	if ranks == nil {
		for r := range n {
			ranks = append(ranks, r)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, n)
	var wg sync.WaitGroup
	f.running.Store(int32(len(ranks)))
	for _, r := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer f.running.Add(-1)
			defer func() {
				if p := recover(); p != nil {
					errs[r] = fmt.Errorf("panic: %v", p)
					f.bugf("rank %d panicked: %v\n%s", r, p, debug.Stack())
				}
			}()
			errs[r] = fn(ctx, &fcComm{f: f, rank: r})
			if errs[r] != nil {
				return
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			for _, q := range f.reqs[r] {
				if !q.isDone() {
					f.bugLocked("rank %d returned before its %s completed", r, q.what)
				}
			}
		}()
	}
	ranksDone := make(chan struct{})
	go func() {
		wg.Wait()
		close(ranksDone)
	}()
	f.watch(ranksDone, cancel)
	idle := make(chan struct{})
	go func() {
		f.busy.Wait()
		close(idle)
	}()
	select {
	case <-idle:
	case <-time.After(30 * time.Second):
		f.bugf("the fake transport's goroutines are still busy 30s after every rank returned")
	}
	o := fcOutcome{errs: errs}
	f.mu.Lock()
	defer f.mu.Unlock()
	o.bugs = append(o.bugs, f.bugs...)
	clean := len(ranks) == n
	for _, err := range errs {
		clean = clean && err == nil
	}
	if clean { // leftovers only mean something when the op succeeded everywhere
		o.bugs = append(o.bugs, f.pendingLocked()...)
	}
	return o
}

// watch returns when every rank has returned. If before that every running rank sits in
// Request.Wait with nothing of the fake's in flight and nothing happening for a while, the op
// is deadlocked: watch records what is pending and cancels the ranks' context.
func (f *fcFabric) watch(ranksDone <-chan struct{}, cancel func()) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	last, still := int64(-1), 0
	for {
		select {
		case <-ranksDone:
			return
		case <-tick.C:
		}
		a := f.activity.Load()
		if running := f.running.Load(); running == 0 || f.blocked.Load() < running || f.inflight.Load() > 0 || a != last {
			last, still = a, 0
			continue
		}
		if still++; still == 25 {
			f.mu.Lock()
			for q := range f.waits {
				if q.isDone() { // a rank about to wake up
					still = 0
				}
			}
			if still == 0 {
				f.mu.Unlock()
				continue
			}
			pending := f.pendingLocked()
			f.bugLocked("deadlock: every rank is waiting and no message is in flight; pending:\n\t\t%s", strings.Join(pending, "\n\t\t"))
			f.mu.Unlock()
			cancel()
		}
	}
}

// pendingLocked lists the messages no receive took and the receives no message matched.
func (f *fcFabric) pendingLocked() []string {
	var left []string
	for k, ms := range f.early {
		left = append(left, fmt.Sprintf("message %v (%d bytes) was sent but never received", k, len(ms[0].data)))
	}
	for k := range f.posted {
		left = append(left, fmt.Sprintf("receive %v was posted but no message matched it", k))
	}
	sort.Strings(left)
	if len(left) > 12 {
		left = append(left[:12], fmt.Sprintf("and %d more", len(left)-12))
	}
	return left
}

// fcTimeout bounds one op of a test that must succeed; it only matters on a deadlock.
const fcTimeout = 60 * time.Second

// fcRunOK runs fn on all n ranks and fails t if any rank fails or the fake saw a violation.
func fcRunOK(t testing.TB, desc string, n int, seed int64, fn func(ctx context.Context, c Comm) error) bool {
	t.Helper()
	o := fcRun(n, seed, fcTimeout, nil, fn)
	if o.failed() {
		t.Errorf("%s (group of %d, case seed %d):%s", desc, n, seed, o)
		return false
	}
	return true
}

// fcBaseSeed is the seed of one test: COLLECTIVES_SEED if set, else the clock. Every case
// derives its own seed from it and its name, so one case can be replayed alone (the data
// exactly; the interleaving of goroutines only roughly).
func fcBaseSeed(t *testing.T) int64 {
	seed := time.Now().UnixNano()
	if s := os.Getenv("COLLECTIVES_SEED"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("COLLECTIVES_SEED=%q: %v", s, err)
		}
		seed = v
	}
	t.Logf("seed %d (COLLECTIVES_SEED=%d go test -run '^%s$' replays it)", seed, seed, t.Name())
	return seed
}

func fcCaseSeed(base int64, name string) int64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return base ^ int64(h.Sum64()>>1)
}

// fcGroupSizes are the group sizes every algorithm is tested with.
var fcGroupSizes = []int{1, 2, 3, 4, 5, 8}
