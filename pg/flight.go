package pg

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocomm/gocomm/transport"
	"github.com/gocomm/gocomm/wire"
)

// flight is a group's flight recorder, in the manner of torch's ProcessGroupNCCL
// FlightRecorder: the last ops of the group with their state and times, so that a hang or a
// failure shows which op every rank was in.
//
// Design:
//  1. Every op the group accepts gets an entry when it is queued; the entry moves to started
//     when the op reaches its engine (the executor for host collectives, the device engine's
//     queue for CUDA ops, posting for point-to-point ops) and to its final state when the
//     client is told.
//  2. Collectives are numbered in submission order, which every rank shares (the group's
//     design 1), whatever engine runs them: seq n is the same call on every rank. Point-to-
//     point ops are numbered apart (p2p_seq, this rank's own order), as torch's recorder does.
//  3. started and finished count the collectives started and finished (the highest seq
//     plus one); the heartbeats carry them, so each rank knows how far each peer got
//     (transport.PeerProgress) without asking it. They are kept when the ring is off (size 0).
//  4. The ring holds pointers: an op keeps its entry after the ring moved past it, and its
//     updates then touch nothing the ring shows.
type flight struct {
	size int

	mu      sync.Mutex
	ring    []*FlightEntry
	next    int // where the next entry goes once the ring is full
	ids     uint64
	collSeq int64
	p2pSeq  int64

	started, finished atomic.Uint64 // invariant 3
}

// FlightEntry is one op as the flight recorder saw it.
type FlightEntry struct {
	ID        uint64     `json:"id"`      // the group's op number (every op, in acceptance order)
	Seq       int64      `json:"seq"`     // collective number, the same on every rank; -1: point to point
	P2PSeq    int64      `json:"p2p_seq"` // point-to-point number on this rank; -1: a collective
	ClientSeq uint64     `json:"client_seq"`
	Op        string     `json:"op"`
	Engine    string     `json:"engine"` // host or nccl
	DType     string     `json:"dtype"`
	RedOp     string     `json:"reduce_op,omitempty"`
	Count     uint64     `json:"count"`
	Bytes     []uint64   `json:"bytes"` // each buffer's bytes, in the descriptor's order
	Peer      int32      `json:"peer"`  // root (rooted collectives), peer (send/recv; -1 any), else -1
	Tag       int32      `json:"tag,omitempty"`
	Timeout   float64    `json:"timeout_s"`
	Enqueued  time.Time  `json:"enqueued"`
	Start     *time.Time `json:"started,omitempty"`
	Launched  *time.Time `json:"launched,omitempty"` // CUDA ops: their GPU work queued on the sidecar's stream
	End       *time.Time `json:"ended,omitempty"`
	State     string     `json:"state"` // queued, started, completed, failed, timed out, aborted, invalid
	Error     string     `json:"error,omitempty"`
}

func newFlight(size int) *flight { return &flight{size: size} }

// record adds an op (invariant 1); it returns the entry the op updates.
func (f *flight) record(d *wire.Desc, engine string, timeout time.Duration) *FlightEntry {
	e := &FlightEntry{
		ClientSeq: d.Seq, Op: d.Kind.String(), Engine: engine, DType: d.DType.String(),
		Count: d.Count, Peer: -1, Timeout: timeout.Seconds(), Enqueued: time.Now(), State: "queued",
	}
	if d.Reduces() {
		e.RedOp = d.RedOp.String()
	}
	switch d.Kind {
	case wire.OpBroadcast, wire.OpReduce, wire.OpGather, wire.OpScatter, wire.OpSend, wire.OpRecv:
		e.Peer = d.Root
	}
	if !d.Kind.Collective() {
		e.Tag = d.Tag
	}
	for _, b := range d.Bufs {
		e.Bytes = append(e.Bytes, b.Length)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ids++
	e.ID = f.ids
	e.Seq, e.P2PSeq = -1, -1
	if d.Kind.Collective() {
		e.Seq = f.collSeq
		f.collSeq++
	} else {
		e.P2PSeq = f.p2pSeq
		f.p2pSeq++
	}
	if f.size <= 0 {
		return e
	}
	if len(f.ring) < f.size {
		f.ring = append(f.ring, e)
	} else {
		f.ring[f.next] = e
		f.next = (f.next + 1) % f.size
	}
	return e
}

// start marks an op started.
func (f *flight) start(e *FlightEntry) {
	now := time.Now()
	f.mu.Lock()
	e.Start, e.State = &now, "started"
	f.mu.Unlock()
	if e.Seq >= 0 {
		raise(&f.started, uint64(e.Seq)+1)
	}
}

// launched marks a CUDA op's GPU work queued: started -> launched is the sidecar's host time
// for the op, enqueued -> started its wait behind earlier ops.
func (f *flight) launched(e *FlightEntry) {
	now := time.Now()
	f.mu.Lock()
	e.Launched = &now
	f.mu.Unlock()
}

// end marks an op done with the status its client is told.
func (f *flight) end(e *FlightEntry, status int32, msg string) {
	now := time.Now()
	f.mu.Lock()
	if e.Start == nil {
		e.Start = &now
	}
	e.End, e.State, e.Error = &now, stateOf(status), msg
	f.mu.Unlock()
	if e.Seq >= 0 {
		raise(&f.started, uint64(e.Seq)+1)
		raise(&f.finished, uint64(e.Seq)+1)
	}
}

// enqueued is how many collectives the group accepted.
func (f *flight) enqueued() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.collSeq
}

// progress is (collectives started, finished), for the heartbeats (invariant 3).
func (f *flight) progress() (uint64, uint64) { return f.started.Load(), f.finished.Load() }

func raise(a *atomic.Uint64, v uint64) {
	for {
		old := a.Load()
		if v <= old || a.CompareAndSwap(old, v) {
			return
		}
	}
}

func stateOf(status int32) string {
	switch status {
	case wire.StatusOK:
		return "completed"
	case wire.StatusTimeout:
		return "timed out"
	case wire.StatusAborted, wire.StatusBroken:
		return "aborted"
	case wire.StatusInvalid:
		return "invalid"
	}
	return "failed"
}

// entries is a copy of the ring, oldest first.
func (f *flight) entries() []FlightEntry {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]FlightEntry, 0, len(f.ring))
	for i := range f.ring {
		out = append(out, *f.ring[(f.next+i)%len(f.ring)])
	}
	return out
}

// GroupRecord is one group's part of a flight record.
type GroupRecord struct {
	Handle uint32 `json:"handle"`
	Name   string `json:"name"`
	Rank   int    `json:"rank"`
	Size   int    `json:"size"`
	// Broken is why the group broke, "" while it works.
	Broken string `json:"broken,omitempty"`
	// LastEnqueued, LastStarted and LastFinished are this rank's last collective seq
	// submitted, started and finished (-1: none).
	LastEnqueued int64         `json:"last_enqueued"`
	LastStarted  int64         `json:"last_started"`
	LastFinished int64         `json:"last_finished"`
	Peers        []PeerRecord  `json:"peers"`
	Ops          []FlightEntry `json:"ops"`
}

// PeerRecord is how far a peer got, as its last heartbeat said.
type PeerRecord struct {
	Rank         int     `json:"rank"`
	LastStarted  int64   `json:"last_started"`
	LastFinished int64   `json:"last_finished"`
	HeardAgo     float64 `json:"heard_s_ago"` // -1: no heartbeat yet
}

// FlightRecord is what Server.FlightRecord returns and the dumps write.
type FlightRecord struct {
	Version string        `json:"version"`
	PID     int           `json:"pid"`
	Rank    int           `json:"rank"` // the first client's global rank, -1 without one
	Time    time.Time     `json:"time"`
	Reason  string        `json:"reason"`
	Groups  []GroupRecord `json:"groups"`
}

// record is the group's part of a flight record.
func (g *Group) record() GroupRecord {
	started, finished := g.flight.progress()
	r := GroupRecord{
		Handle: g.Handle, Name: g.Name, Rank: g.Rank, Size: g.Size,
		LastEnqueued: g.flight.enqueued() - 1, LastStarted: int64(started) - 1, LastFinished: int64(finished) - 1,
		Ops: g.flight.entries(), Peers: []PeerRecord{},
	}
	g.mu.Lock()
	ep, closing := g.ep, g.closing
	g.mu.Unlock()
	r.Broken = closing
	if ep != nil { // the cause of a break outlives the group's destruction
		if err := ep.Broken(); err != nil && !errors.Is(err, transport.ErrClosed) {
			r.Broken = err.Error()
		}
	}
	if ep != nil {
		for peer, p := range ep.Peers() {
			if peer == g.Rank {
				continue
			}
			pr := PeerRecord{Rank: peer, LastStarted: int64(p.Started) - 1, LastFinished: int64(p.Finished) - 1, HeardAgo: -1}
			if !p.Heard.IsZero() {
				pr.HeardAgo = time.Since(p.Heard).Seconds()
			}
			r.Peers = append(r.Peers, pr)
		}
	}
	return r
}

// FlightRecord collects every group's flight record, and those of also (groups that broke,
// still shown once their client destroyed them).
func (s *Server) FlightRecord(reason string, also ...*Group) FlightRecord {
	rec := FlightRecord{Version: s.cfg.Version, PID: os.Getpid(), Rank: -1, Time: time.Now(), Reason: reason, Groups: []GroupRecord{}}
	for _, sess := range s.Sessions() {
		if rec.Rank < 0 {
			rec.Rank = sess.rank
		}
	}
	groups := s.Groups()
	for _, g := range also {
		if !slices.Contains(groups, g) {
			groups = append(groups, g)
		}
	}
	sort.Slice(groups, func(i, j int) bool { return groups[i].Handle < groups[j].Handle })
	for _, g := range groups {
		rec.Groups = append(rec.Groups, g.record())
	}
	return rec
}

// logTail is how many of a group's last ops a dump puts in the log (the file has them all).
const logTail = 8

// DumpFlightRecord writes the flight record to the log (each group's progress, its peers'
// and its last ops) and, as JSON, to the dump file (Config.TraceFile). It returns the file's
// path ("" when none was written).
func (s *Server) DumpFlightRecord(reason string, also ...*Group) (string, error) {
	rec := s.FlightRecord(reason, also...)
	for _, g := range rec.Groups {
		ops := g.Ops[max(0, len(g.Ops)-logTail):]
		tail, _ := json.Marshal(ops)
		peers, _ := json.Marshal(g.Peers)
		s.log.Warn("flight record", "reason", reason, "group", g.Handle, "name", g.Name, "grank", g.Rank,
			"last_started", g.LastStarted, "last_finished", g.LastFinished, "broken", g.Broken,
			"peers", string(peers), "last_ops", string(tail))
	}
	if s.cfg.TraceFile == nil {
		return "", nil
	}
	path := s.cfg.TraceFile(rec.Rank)
	if path == "" {
		return "", nil
	}
	b, err := json.MarshalIndent(rec, "", " ")
	if err == nil {
		err = writeFileAtomic(path, b)
	}
	if err != nil {
		s.log.Warn("flight record not written", "path", path, "err", err)
		return "", err
	}
	s.log.Warn("flight record written", "path", path, "reason", reason)
	return path, nil
}

// dumpSoon dumps the flight record a moment after group g broke, so the ops the break
// failed show their final state; breaks close together make one dump, which shows their
// groups even if their clients destroyed them meanwhile.
func (s *Server) dumpSoon(g *Group, reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.dumpGroups = append(s.dumpGroups, g)
	if len(s.dumpGroups) > 1 {
		return
	}
	time.AfterFunc(200*time.Millisecond, func() {
		s.mu.Lock()
		also := s.dumpGroups
		s.dumpGroups = nil
		s.mu.Unlock()
		s.DumpFlightRecord(reason, also...)
	})
}

func writeFileAtomic(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp := fmt.Sprintf("%s.%d.tmp", path, os.Getpid())
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
