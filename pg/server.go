// Package pg is the sidecar's domain: client sessions, the process groups they create, the
// shared-memory segments their tensors live in, and the executor that runs each group's ops
// in order under a deadline. The gRPC edge (package rpc) translates to and from these calls;
// nothing here imports proto types.
package pg

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/dl"
	"github.com/gocomm/gocomm/node"
	"github.com/gocomm/gocomm/ring"
	"github.com/gocomm/gocomm/shm"
	"github.com/gocomm/gocomm/sparse"
	"github.com/gocomm/gocomm/transport"
	"github.com/gocomm/gocomm/wire"
)

// Config of a Server.
type Config struct {
	// Version reported by Info.
	Version string
	// ShmDir holds the shared-memory files (rings, segments).
	ShmDir string
	// RingBytes is the default capacity of each ring queue.
	RingBytes int
	// Spin is how long a session's loop polls its ring before sleeping on the futex. Spinning
	// costs a core but saves the wake-up latency (a few microseconds) on busy GPU ranks.
	Spin time.Duration
	// Device is the GPU engine, or nil where the sidecar serves CPU tensors only.
	Device gpu.Engine
	// Sparse picks a client's sparse all-to-all engine when it attaches (sparse.NewChooser);
	// it is handed the engine's NVSHMEM loader. An error refuses the client (an engine forced
	// where it cannot run). Nil: always NCCL.
	Sparse sparse.Chooser
	// Node is what the sidecar knows of its node (node.Describe), reported by Info and, with
	// each client's own facts, by Attach.
	Node []node.Fact
	// TraceSize is how many of its last ops each group's flight recorder keeps (0: none).
	TraceSize int
	// TraceFile names the flight record's JSON dump for a rank (nil or "": no file).
	TraceFile func(rank int) string
	// DumpOnFailure dumps the flight record when a group breaks.
	DumpOnFailure bool
	// FDSocket is where ServeFDs listens, told to clients at Attach ("" where it does not).
	FDSocket string
}

// SparseChoice is the engine all_to_all_v of a client's CUDA tensors takes, and why.
type SparseChoice = sparse.Choice

// Engine describes one way ops can run (Info).
type Engine struct {
	Name      string
	Available bool
	Detail    string
}

// Server is one sidecar.
type Server struct {
	cfg     Config
	node    *transport.Node
	log     *slog.Logger
	started time.Time

	mu       sync.Mutex
	sessions map[uint64]*Session
	groups   map[uint32]*Group
	nextSess uint64
	nextGrp  uint32
	closed   bool
	sparse   *SparseChoice // the last attached client's, for Info
	client   []node.Fact   // the last attached client's facts, for Info

	dumpGroups []*Group     // broken groups a flight record dump is on its way for (dumpSoon)
	fdUID      atomic.Int64 // the uid an fd socket's peer must run as: ours
}

// ErrShutdown: the server is shutting down.
var ErrShutdown = errors.New("pgserver is shutting down")

// NewServer builds a server whose groups reach their peers through node.
func NewServer(cfg Config, node *transport.Node, log *slog.Logger) *Server {
	if cfg.ShmDir == "" {
		cfg.ShmDir = shm.DefaultDir()
	}
	if cfg.RingBytes == 0 {
		cfg.RingBytes = 1 << 20
	}
	transport.SetOpNames(func(op uint8) string { return wire.OpKind(op).String() })
	s := &Server{
		cfg: cfg, node: node, log: log, started: time.Now(),
		sessions: map[uint64]*Session{}, groups: map[uint32]*Group{},
	}
	s.fdUID.Store(int64(os.Getuid()))
	return s
}

// Version of the server.
func (s *Server) Version() string { return s.cfg.Version }

// PeerAddress is where peers reach this sidecar.
func (s *Server) PeerAddress() string { return s.node.Addr() }

// Uptime since the server was built.
func (s *Server) Uptime() time.Duration { return time.Since(s.started) }

// Engines available on this sidecar; "sparse" is the engine chosen for the last client
// that attached.
func (s *Server) Engines() []Engine {
	out := []Engine{{Name: "host", Available: true, Detail: "CPU tensors over TCP between sidecars"}}
	if s.cfg.Device == nil {
		out = append(out, Engine{Name: "nccl", Detail: "no GPU engine in this sidecar"})
	} else {
		ok, detail, _ := s.cfg.Device.Info()
		out = append(out, Engine{Name: "nccl", Available: ok, Detail: detail})
	}
	s.mu.Lock()
	c := s.sparse
	s.mu.Unlock()
	if c == nil {
		return append(out, Engine{Name: "sparse", Available: true, Detail: "chosen when a client attaches"})
	}
	return append(out, Engine{Name: "sparse", Available: true, Detail: c.Engine + ": " + c.Reason})
}

// Capabilities are the node's facts and those of the last client that attached (Info).
func (s *Server) Capabilities() []node.Fact {
	s.mu.Lock()
	client := s.client
	s.mu.Unlock()
	if client == nil {
		client = []node.Fact{
			{Name: node.NCCL, Value: node.Unknown, Reason: "decided when a client attaches"},
			{Name: node.NVSHMEM, Value: node.Unknown, Reason: "decided when a client attaches"},
		}
	}
	return append(append([]node.Fact(nil), s.cfg.Node...), client...)
}

// clientFacts loads the NCCL a client names and picks its sparse engine: the client's facts
// (nccl, nvshmem) Attach reports, and whether its NCCL loaded.
func (s *Server) clientFacts(ncclPath string) (SparseChoice, []node.Fact, bool, error) {
	if ncclPath != "" {
		// loading runs the library's code here: only a file no one else could have written
		if err := dl.Trusted(ncclPath); err != nil {
			s.log.Warn("not loading the NCCL the client named; taking the loader's search instead", "err", err)
			ncclPath = ncclSoname
		}
	}
	var ncclErr error
	switch {
	case ncclPath == "":
	case s.cfg.Device == nil:
		ncclErr = errors.New("this sidecar has no GPU engine")
	default:
		if ncclErr = s.cfg.Device.LoadNCCL(ncclPath); ncclErr != nil {
			s.log.Warn("NCCL not loaded; CUDA tensors will fail", "path", ncclPath, "err", ncclErr)
		}
	}
	ncclFact := node.LoadedNCCL(ncclPath, ncclErr)
	choice, err := s.chooseSparse(ncclFact.Holds())
	return choice, []node.Fact{ncclFact, choice.NVSHMEM}, ncclFact.Holds(), err
}

// Probe decides what Attach would for a client naming ncclPath, with no session: its sparse
// engine, which Engines and Capabilities report after (`pgserver info`, which serves no one).
func (s *Server) Probe(ncclPath string) (SparseChoice, error) {
	choice, client, _, err := s.clientFacts(ncclPath)
	if err != nil {
		return choice, err
	}
	s.mu.Lock()
	s.sparse, s.client = &choice, client
	s.mu.Unlock()
	return choice, nil
}

// chooseSparse picks the sparse engine of a client attaching with (hasNCCL) or without
// its NCCL loaded. A client without it moves no CUDA tensors: NCCL, whatever was asked.
func (s *Server) chooseSparse(hasNCCL bool) (SparseChoice, error) {
	switch {
	case s.cfg.Device == nil:
		return sparse.Default("no GPU engine in this sidecar"), nil
	case !hasNCCL:
		return sparse.Default("the client has no NCCL loaded"), nil
	case s.cfg.Sparse == nil:
		return sparse.Default("no sparse transport choice configured"), nil
	}
	return s.cfg.Sparse(s.cfg.Device.LoadNVSHMEM)
}

// Device is the GPU engine (nil without one).
func (s *Server) Device() gpu.Engine { return s.cfg.Device }

// ncclSoname is what the loader searches for when the NCCL a client named is refused.
const ncclSoname = "libnccl.so.2"

// Attach opens a session for a client process: it creates the ring file the client maps.
// ncclPath names the NCCL the client loaded ("" when it has none); the sidecar loads the same
// library, so that groups get communicator ids from it, if dl.Trusted passes it (else the
// loader's search).
func (s *Server) Attach(clientPID int64, rank int, ringBytes int, ncclPath string) (*Session, error) {
	if ringBytes <= 0 {
		ringBytes = s.cfg.RingBytes
	}
	if ringBytes > 1<<28 {
		return nil, fmt.Errorf("%w: ring of %d bytes", wire.ErrInvalid, ringBytes)
	}
	mem, err := shm.Create(s.cfg.ShmDir, "gocomm-ring", ring.Size(ringBytes))
	if err != nil {
		return nil, err
	}
	if err := ring.Format(mem.Data, ringBytes); err != nil {
		mem.Close()
		return nil, err
	}
	sub, cmp, err := ring.Open(mem.Data)
	if err != nil {
		mem.Close()
		return nil, err
	}
	marks, err := ring.OpenMarks(mem.Data)
	if err != nil {
		mem.Close()
		return nil, err
	}
	choice, client, hasNCCL, err := s.clientFacts(ncclPath)
	if err != nil {
		mem.Close()
		return nil, err
	}
	var token FDToken
	if _, err := rand.Read(token[:]); err != nil {
		mem.Close()
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		mem.Close()
		return nil, ErrShutdown
	}
	s.sparse = &choice
	s.client = client
	s.nextSess++
	sess := &Session{
		ID: s.nextSess, srv: s, pid: clientPID, rank: rank,
		ringMem: mem, cons: ring.NewConsumer(sub), prod: ring.NewProducer(cmp), marks: marks,
		reg:          newRegistry(s.cfg.ShmDir),
		groups:       map[uint32]*Group{},
		done:         make(chan struct{}),
		events:       make(chan Event, 64),
		log:          s.log.With("session", s.nextSess, "rank", rank),
		nccl:         hasNCCL,
		Sparse:       choice,
		Capabilities: append(append([]node.Fact(nil), s.cfg.Node...), client...),
		fdToken:      token,
	}
	sess.graphs = newTriggers(sess)
	s.sessions[sess.ID] = sess
	go sess.serve()
	sess.log.Info("client attached", "pid", clientPID, "ring", mem.Path, "nccl", sess.nccl,
		"sparse", choice.Engine, "why", choice.Reason)
	return sess, nil
}

// Session returns a live session.
func (s *Server) Session(id uint64) (*Session, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sess := s.sessions[id]; sess != nil {
		return sess, nil
	}
	return nil, fmt.Errorf("session %d: %w", id, ErrNotFound)
}

// Sessions returns the live sessions.
func (s *Server) Sessions() []*Session {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Session, 0, len(s.sessions))
	for _, sess := range s.sessions {
		out = append(out, sess)
	}
	return out
}

// Groups returns every group of every session.
func (s *Server) Groups() []*Group {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Group, 0, len(s.groups))
	for _, g := range s.groups {
		out = append(out, g)
	}
	return out
}

// Abandon is the sidecar going away without its clients having left (a signal, its client
// process gone): every session's groups are aborted with reason, so peers fail at once
// naming this rank; then everything closes as in Shutdown.
func (s *Server) Abandon(reason string) {
	if s.node != nil {
		s.node.Ending() // peers dialing a group its client made but never joined fail now
	}
	for _, sess := range s.Sessions() {
		sess.Gone(reason)
	}
	s.Shutdown(reason)
}

// Shutdown fails whatever is pending and closes every session.
func (s *Server) Shutdown(reason string) {
	s.mu.Lock()
	s.closed = true
	sessions := make([]*Session, 0, len(s.sessions))
	for _, sess := range s.sessions {
		sessions = append(sessions, sess)
	}
	s.mu.Unlock()
	for _, sess := range sessions {
		sess.Close(reason)
	}
}

// Locate finds bytes inside a segment of any session (transport.Config.Locate): sends from
// op buffers then go to same-host peers by reference.
func (s *Server) Locate(b []byte) (fd int, ino, off uint64, ok bool) {
	s.mu.Lock()
	sessions := make([]*Session, 0, len(s.sessions))
	for _, sess := range s.sessions {
		sessions = append(sessions, sess)
	}
	s.mu.Unlock()
	for _, sess := range sessions {
		if fd, ino, off, ok = sess.reg.locate(b); ok {
			return fd, ino, off, ok
		}
	}
	return 0, 0, 0, false
}

// bootstrap is the blob a member publishes to its peers through the torch Store.
type bootstrap struct {
	Addr     string `json:"addr"`
	Hostname string `json:"hostname"`
	PID      int    `json:"pid"`
	Version  string `json:"version"`
	// NCCL holds rank 0's communicator ids (collectives, point to point).
}

func (s *Server) bootstrapBlob() []byte {
	host, _ := os.Hostname()
	b, _ := json.Marshal(bootstrap{Addr: s.node.Addr(), Hostname: host, PID: os.Getpid(), Version: s.cfg.Version})
	return b
}

func (s *Server) addGroup(g *Group) {
	s.mu.Lock()
	s.nextGrp++
	g.Handle = s.nextGrp
	s.groups[g.Handle] = g
	s.mu.Unlock()
}

func (s *Server) dropGroup(g *Group) {
	s.mu.Lock()
	delete(s.groups, g.Handle)
	s.mu.Unlock()
}

func (s *Server) dropSession(sess *Session) {
	s.mu.Lock()
	delete(s.sessions, sess.ID)
	s.mu.Unlock()
}
