// Package rpc is pgserver's gRPC edge: each method translates a request into a call on the
// pg domain and the result into a response. Errors map to gRPC status codes in one place
// (toStatus); nothing below this package sees proto types.
package rpc

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/gocomm/gocomm/config"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/node"
	"github.com/gocomm/gocomm/pg"
	v1 "github.com/gocomm/gocomm/proto/gocomm/v1"
	"github.com/gocomm/gocomm/wire"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Host describes the sidecar's process, for Info, and the settings it reports at Attach.
type Host struct {
	RuntimeDir string
	LogFile    string
	A2A        config.A2A    // the sparse all-to-all's, which the client's kernel uses too
	TraceSize  int           // GOCOMM_TRACE_BUFFER_SIZE, which the client's own record uses too
	Client     config.Client // the training process's knobs, read here for it (config.Client)
	// Getenv is the environment the settings were read from (os.Getenv): Attach names the
	// knobs a client's environment sets otherwise (config.ClientDiffs). nil: none named.
	Getenv func(string) string
}

// Service implements v1.PGServerServer on a pg.Server.
type Service struct {
	v1.UnimplementedPGServerServer
	srv      *pg.Server
	host     Host
	shutdown func(reason string)
}

// NewService serves srv; shutdown is called (once, asynchronously) by the Shutdown rpc.
func NewService(srv *pg.Server, host Host, shutdown func(reason string)) *Service {
	return &Service{srv: srv, host: host, shutdown: shutdown}
}

// Register adds the service to a gRPC server.
func (s *Service) Register(gs *grpc.Server) { v1.RegisterPGServerServer(gs, s) }

// toStatus maps domain errors to gRPC status codes.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	switch {
	case errors.Is(err, wire.ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, wire.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, pg.ErrShutdown):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, pg.ErrNoDevice):
		return status.Error(codes.FailedPrecondition, err.Error())
	default:
		return status.Error(codes.Internal, err.Error())
	}
}

func (s *Service) Info(context.Context, *v1.InfoRequest) (*v1.InfoResponse, error) {
	host, _ := os.Hostname()
	resp := &v1.InfoResponse{
		Version:     s.srv.Version(),
		Pid:         int64(os.Getpid()),
		Hostname:    host,
		CudaError:   "this sidecar has no GPU engine",
		PeerAddress: s.srv.PeerAddress(),
		RuntimeDir:  s.host.RuntimeDir,
		LogFile:     s.host.LogFile,
	}
	resp.Capabilities = capabilities(s.srv.Capabilities())
	for _, e := range s.srv.Engines() {
		resp.Engines = append(resp.Engines, &v1.Engine{Name: e.Name, Available: e.Available, Detail: e.Detail})
	}
	if dev := s.srv.Device(); dev != nil {
		ok, detail, devices := dev.Info()
		resp.CudaAvailable, resp.CudaError = ok, ""
		if !ok {
			resp.CudaError = detail
		}
		for _, d := range devices {
			resp.Devices = append(resp.Devices, &v1.Device{Index: int32(d.Index), Name: d.Name, Uuid: fmt.Sprintf("%x", d.UUID)})
		}
	}
	return resp, nil
}

func (s *Service) Health(context.Context, *v1.HealthRequest) (*v1.HealthResponse, error) {
	resp := &v1.HealthResponse{Serving: true, UptimeSeconds: s.srv.Uptime().Seconds()}
	for _, g := range s.srv.Groups() {
		gh := &v1.GroupHealth{Group: g.Handle, Name: g.Name}
		if err := g.Broken(); err != nil {
			gh.Broken, gh.Error = true, err.Error()
		}
		resp.Groups = append(resp.Groups, gh)
	}
	return resp, nil
}

func (s *Service) Attach(_ context.Context, req *v1.AttachRequest) (*v1.AttachResponse, error) {
	sess, err := s.srv.Attach(req.ClientPid, int(req.Rank), int(req.RingBytes), req.NcclPath)
	if err != nil {
		return nil, toStatus(err)
	}
	token := sess.FDToken()
	var diffs []string
	if s.host.Getenv != nil && len(req.ClientEnv) > 0 {
		diffs = config.ClientDiffs(s.host.Getenv, func(k string) string { return req.ClientEnv[k] })
	}
	return &v1.AttachResponse{
		Session: sess.ID, RingPath: sess.RingPath(), RingBytes: uint64(sess.RingBytes()),
		SparseTransport: sess.Sparse.Engine, SparseReason: sess.Sparse.Reason,
		Capabilities: capabilities(sess.Capabilities),
		A2A: &v1.A2AConfig{
			RecvBytes: uint64(s.host.A2A.RecvBytes), Blocks: uint32(s.host.A2A.Blocks), Threads: uint32(s.host.A2A.Threads),
		},
		TraceBufferSize: uint32(s.host.TraceSize),
		Knobs:           clientKnobs(s.host.Client),
		FdSocket:        s.srv.FDSocket(), FdToken: token[:],
		CudaRefusal:  cudaRefusal(s.host.Client.CUDA, s.srv.Device()),
		KnobWarnings: diffs,
	}, nil
}

// cudaRefusal is why a client's CUDA tensors cannot be served ("" where they can): the knob
// turned the engine off, or this sidecar cannot run CUDA ops (dev nil: it has no GPU engine).
func cudaRefusal(knob bool, dev gpu.Engine) string {
	if !knob {
		return "and gocomm's CUDA engine is turned off (GOCOMM_CUDA=0)"
	}
	why := "this sidecar has no GPU engine"
	if dev != nil {
		ok, detail, _ := dev.Info()
		if ok {
			return ""
		}
		why = detail
	}
	return "but this rank's pgserver cannot run CUDA ops: " + why
}

func clientKnobs(c config.Client) *v1.ClientKnobs {
	ar := c.AllReduce
	return &v1.ClientKnobs{
		Cuda: c.CUDA, AsyncErrorHandling: uint32(c.AsyncErrorHandling), A2AvInprocess: c.A2AVInProcess,
		ArMax: uint64(ar.Max), ArStage: uint64(ar.Stage), ArOneshot: uint64(ar.OneShot), ArBlocks: uint32(ar.Blocks),
		MoeLlBytes: uint64(c.MoELowLatencyBytes),
	}
}

func capabilities(facts []node.Fact) []*v1.Capability {
	out := make([]*v1.Capability, len(facts))
	for i, f := range facts {
		out[i] = &v1.Capability{Name: f.Name, Value: f.Value, Reason: f.Reason}
	}
	return out
}

func (s *Service) AttachDevice(_ context.Context, req *v1.AttachDeviceRequest) (*v1.AttachDeviceResponse, error) {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	if len(req.DeviceUuid) != 16 {
		return nil, status.Errorf(codes.InvalidArgument, "device_uuid has %d bytes, want 16", len(req.DeviceUuid))
	}
	var uuid [16]byte
	copy(uuid[:], req.DeviceUuid)
	path, err := sess.AttachDevice(uuid)
	if err != nil {
		return nil, toStatus(err)
	}
	return &v1.AttachDeviceResponse{CountersPath: path}, nil
}

// Watch holds the session open: when the client's stream ends, the session closes; when the
// session or the server ends, the stream does.
func (s *Service) Watch(req *v1.WatchRequest, stream v1.PGServer_WatchServer) error {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return toStatus(err)
	}
	gone := fmt.Sprintf("the training process (pid %d) went away without leaving the group", sess.ClientPID())
	if err := stream.Send(&v1.WatchEvent{Kind: "attached"}); err != nil {
		sess.Gone(gone)
		return err
	}
	for {
		select {
		case <-stream.Context().Done():
			sess.Gone(gone) // a session detached first is closed already
			return nil
		case e := <-sess.Events():
			stream.Send(&v1.WatchEvent{Kind: e.Kind, Group: e.Group, Detail: e.Detail})
		case <-sess.Done():
			stream.Send(&v1.WatchEvent{Kind: "shutdown", Detail: "session closed"})
			return nil
		}
	}
}

// Detach ends a session in order (pg.Session.Detach).
func (s *Service) Detach(_ context.Context, req *v1.DetachRequest) (*v1.DetachResponse, error) {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	sess.Detach(cmp.Or(req.Reason, "client detached"))
	return &v1.DetachResponse{}, nil
}

// FlightRecord returns (and with dump, writes) the flight record of every group.
func (s *Service) FlightRecord(_ context.Context, req *v1.FlightRecordRequest) (*v1.FlightRecordResponse, error) {
	reason := cmp.Or(req.Reason, "asked for by the client")
	resp := &v1.FlightRecordResponse{}
	if req.Dump {
		path, err := s.srv.DumpFlightRecord(reason)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "flight record: %v", err)
		}
		resp.Path = path
	}
	b, err := json.Marshal(s.srv.FlightRecord(reason))
	if err != nil {
		return nil, status.Errorf(codes.Internal, "flight record: %v", err)
	}
	resp.Json = string(b)
	return resp, nil
}

func (s *Service) AllocSegment(_ context.Context, req *v1.AllocSegmentRequest) (*v1.AllocSegmentResponse, error) {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	id, path, size, err := sess.AllocSegment(req.Bytes)
	if err != nil {
		return nil, toStatus(err)
	}
	return &v1.AllocSegmentResponse{Segment: id, Path: path, Bytes: size}, nil
}

func (s *Service) FreeSegment(_ context.Context, req *v1.FreeSegmentRequest) (*v1.FreeSegmentResponse, error) {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	return &v1.FreeSegmentResponse{}, toStatus(sess.FreeSegment(req.Segment))
}

func (s *Service) CreateGroup(_ context.Context, req *v1.CreateGroupRequest) (*v1.CreateGroupResponse, error) {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	global := make([]int, len(req.GlobalRanks))
	for i, r := range req.GlobalRanks {
		global[i] = int(r)
	}
	g, blob, err := sess.CreateGroup(req.Name, int(req.Rank), int(req.Size), global, wire.Millis(req.TimeoutMs))
	if err != nil {
		return nil, toStatus(err)
	}
	return &v1.CreateGroupResponse{Group: g.Handle, Bootstrap: blob, CounterSlot: int32(g.Slot), CounterBase: g.Base[:]}, nil
}

func (s *Service) ConnectGroup(_ context.Context, req *v1.ConnectGroupRequest) (*v1.ConnectGroupResponse, error) {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	transport, err := sess.ConnectGroup(req.Group, req.Bootstrap, req.Secret)
	if err != nil {
		return nil, toStatus(err)
	}
	return &v1.ConnectGroupResponse{Transport: transport}, nil
}

func (s *Service) ShmemID(_ context.Context, req *v1.ShmemIDRequest) (*v1.ShmemIDResponse, error) {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	id, err := sess.ShmemID(req.Group, req.Id)
	if err != nil {
		return nil, toStatus(err)
	}
	return &v1.ShmemIDResponse{Id: id}, nil
}

func (s *Service) DestroyGroup(_ context.Context, req *v1.DestroyGroupRequest) (*v1.DestroyGroupResponse, error) {
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	return &v1.DestroyGroupResponse{}, toStatus(sess.DestroyGroup(req.Group))
}

func (s *Service) Stats(_ context.Context, req *v1.StatsRequest) (*v1.StatsResponse, error) {
	var sessions []*pg.Session
	if req.Session == 0 {
		sessions = s.srv.Sessions()
	} else {
		sess, err := s.srv.Session(req.Session)
		if err != nil {
			return nil, toStatus(err)
		}
		sessions = []*pg.Session{sess}
	}
	resp := &v1.StatsResponse{}
	for _, sess := range sessions {
		cs := sess.CUDASegments()
		resp.Sessions = append(resp.Sessions, &v1.SessionStats{
			Session: sess.ID, CudaSegments: uint32(cs.Live), CudaSegmentsMapped: uint32(cs.Mapped),
			CudaBytesMapped: cs.MappedBytes, CudaSegmentsUnmapped: cs.Unmapped,
		})
		for _, g := range sess.Groups() {
			st := g.Stats()
			resp.Groups = append(resp.Groups, &v1.GroupStats{
				Group: g.Handle, Name: g.Name, Ops: st.Ops, Errors: st.Errors,
				BytesSent: st.Sent, BytesReceived: st.Recv, BytesByReference: st.ByRef,
			})
		}
	}
	return resp, nil
}

func (s *Service) Abort(_ context.Context, req *v1.AbortRequest) (*v1.AbortResponse, error) {
	reason := req.Reason
	if reason == "" {
		reason = "aborted by the client"
	}
	if req.Session == 0 {
		for _, sess := range s.srv.Sessions() {
			sess.Abort(0, reason)
		}
		return &v1.AbortResponse{}, nil
	}
	sess, err := s.srv.Session(req.Session)
	if err != nil {
		return nil, toStatus(err)
	}
	return &v1.AbortResponse{}, toStatus(sess.Abort(req.Group, reason))
}

func (s *Service) Shutdown(_ context.Context, req *v1.ShutdownRequest) (*v1.ShutdownResponse, error) {
	reason := req.Reason
	if reason == "" {
		reason = "shutdown requested"
	}
	go s.shutdown(reason)
	return &v1.ShutdownResponse{}, nil
}
