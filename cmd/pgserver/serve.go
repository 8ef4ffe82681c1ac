package main

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"runtime/trace"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gocomm/gocomm/collectives/device"
	"github.com/gocomm/gocomm/config"
	gonvml "github.com/gocomm/gocomm/internal/nvml"
	"github.com/gocomm/gocomm/kernels"
	gonode "github.com/gocomm/gocomm/node"
	"github.com/gocomm/gocomm/pg"
	"github.com/gocomm/gocomm/rpc"
	"github.com/gocomm/gocomm/sparse"
	"github.com/gocomm/gocomm/transport"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

// options are pgserver's flags.
type options struct {
	runtimeDir  string
	socket      string
	logFile     string
	logLevel    string
	listen      string
	advertise   string
	ifname      string
	rendezvous  string
	parentPID   int
	spin        time.Duration
	spinSet     bool // --spin was given: it wins over GOCOMM_SPIN
	showVersion bool
}

// parseFlags reads args into options.
func parseFlags(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("pgserver", flag.ContinueOnError)
	fs.StringVar(&o.runtimeDir, "runtime-dir", defaultRuntimeDir(), "private directory (0700) for the control socket")
	fs.StringVar(&o.socket, "socket", "", "control socket path (default <runtime-dir>/pgserver-<pid>.sock)")
	fs.StringVar(&o.logFile, "log-file", "", "append the log here (default stderr)")
	fs.StringVar(&o.logLevel, "log-level", "", "debug, info, warn or error (default: $GOCOMM_LOG_LEVEL, else info)")
	fs.StringVar(&o.listen, "listen", "", "host:port peer sidecars connect to (default: $GOCOMM_LISTEN_ADDR, else the advertised address, any port)")
	fs.StringVar(&o.advertise, "advertise", "", "host name or address peers dial (default: $GOCOMM_ADVERTISE_ADDR, else chosen from --socket-ifname, then --rendezvous)")
	fs.StringVar(&o.ifname, "socket-ifname", "", "advertise this interface's address (default: $GOCOMM_SOCKET_IFNAME)")
	fs.StringVar(&o.rendezvous, "rendezvous", "", "the host every rank bootstraps through (the torch Store's): advertise the local address of the route there")
	fs.IntVar(&o.parentPID, "parent-pid", 0, "exit when this process exits (the shim passes its own pid)")
	fs.DurationVar(&o.spin, "spin", 0, "poll the submission ring (and device workers their queues) this long before sleeping (default: $GOCOMM_SPIN, else 2ms where CUDA is available)")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	err := fs.Parse(args)
	fs.Visit(func(f *flag.Flag) { o.spinSet = o.spinSet || f.Name == "spin" })
	if err == nil && o.spinSet && (o.spin < 0 || o.spin > config.MaxSpin) {
		err = fmt.Errorf("--spin %v: want 0 up to %v", o.spin, config.MaxSpin)
	}
	if err == nil && fs.NArg() > 0 {
		// a command this pgserver does not have must not start a server instead
		err = fmt.Errorf("unknown command %q (pgserver takes doctor, info, launch, or flags only)", fs.Arg(0))
	}
	return o, err
}

func run(args []string) error {
	if len(args) > 0 {
		switch args[0] {
		case "doctor":
			return doctor(args[1:], os.Stdout)
		case "info":
			return info(args[1:], os.Stdout)
		case "launch":
			code, err := launch(args[1:], os.Stderr)
			if errors.Is(err, flag.ErrHelp) {
				code, err = 0, nil
			}
			if err != nil {
				fmt.Fprintln(os.Stderr, "pgserver:", err)
			}
			os.Exit(endAsJob(code))
		}
	}
	o, err := parseFlags(args)
	if err != nil {
		return err
	}
	if o.showVersion {
		fmt.Println(version)
		return nil
	}
	// Every GOCOMM_* knob, read once; a value the table does not accept stops us here.
	cfg, deprecated, err := config.FromEnv()
	if err != nil {
		return err
	}
	o.logLevel = cmp.Or(o.logLevel, cfg.LogLevel)
	log, closeLog, err := prepare(&o, cfg.Log)
	if err != nil {
		return err
	}
	defer closeLog()
	for _, w := range deprecated {
		log.Warn(w)
	}
	if cfg.Trace.GoTrace != "" {
		stop, err := goTrace(cfg.Trace.GoTrace)
		if err != nil {
			return err
		}
		defer stop()
	}

	// flags win over the knobs (a standalone pgserver takes either)
	listen := cmp.Or(o.listen, cfg.Peers.Listen)
	host, why, err := transport.ChooseAddress(transport.AddressSpec{
		Advertise: cmp.Or(o.advertise, cfg.Peers.Advertise), Ifname: cmp.Or(o.ifname, cfg.Peers.Ifname), Rendezvous: o.rendezvous,
	})
	if err != nil {
		return err
	}
	log.Info("peer address", "advertise", host, "why", why, "listen", cmp.Or(listen, host))
	var srv *pg.Server // set before any group exists, so before Locate is ever called
	node, err := transport.Listen(transport.Config{
		Listen: listen, Advertise: host, Log: log, PeerTimeout: cfg.Peers.DeadTimeout,
		HandshakeTimeout: cfg.Peers.HandshakeTimeout, HandshakesMax: cfg.Peers.HandshakesMax,
		UnmatchedMax: cfg.Peers.UnmatchedBytesMax,
		Locate:       func(b []byte) (int, uint64, uint64, bool) { return srv.Locate(b) },
	})
	if err != nil {
		return err
	}
	defer node.Close()
	pcfg, err := engines(log, cfg, o)
	if err != nil {
		return err
	}
	pcfg.TraceSize, pcfg.DumpOnFailure = cfg.Trace.Size, cfg.Trace.OnFailure
	pcfg.TraceFile = traceFile(cfg.Trace.File, o.logFile)
	// the fd socket beside the control socket: chunks of CUDA memory by file descriptor. Where
	// it cannot be made (a path past the 107 bytes a unix socket takes), the sidecar runs
	// without it: clients are told none, and refuse such memory saying so.
	fdPath := strings.TrimSuffix(o.socket, ".sock") + ".fd.sock"
	fdln, err := listenFDSocket(fdPath)
	if err != nil {
		log.Warn("no fd socket: tensors in expandable segments will be refused", "err", err)
	} else {
		pcfg.FDSocket = fdPath
		defer os.Remove(fdPath)
		defer fdln.Close()
	}
	srv = pg.NewServer(pcfg, node, log)
	if fdln != nil {
		go func() {
			if err := srv.ServeFDs(fdln); err != nil {
				log.Error("fd socket", "err", err)
			}
		}()
	}

	uln, err := listenUnix(o.socket)
	if err != nil {
		return err
	}
	ln := &peerCredListener{Listener: uln, log: log, uid: os.Getuid()}
	gs := grpc.NewServer()
	var once sync.Once
	// stop is the client's Shutdown: its sessions leave in order. abandon is any other end
	// (a signal, the parent rank gone): the groups are aborted, so peers fail at once.
	end := func(reason string, orderly bool) {
		once.Do(func() {
			log.Info("shutting down", "reason", reason, "orderly", orderly)
			if !orderly {
				srv.Abandon(reason)
				gs.Stop()
				return
			}
			srv.Shutdown(reason)
			// Stop would cut the connections at once, the Shutdown rpc's own answer with them:
			// its client, seeing no answer, would kill this process in the middle of its
			// cleanup. In-flight rpcs get shutdownGrace to finish.
			stopped := make(chan struct{})
			go func() { gs.GracefulStop(); close(stopped) }()
			select {
			case <-stopped:
			case <-time.After(shutdownGrace):
				gs.Stop()
			}
		})
	}
	stop := func(reason string) { end(reason, true) }
	abandon := func(reason string) { end(reason, false) }
	rpc.NewService(srv, rpc.Host{RuntimeDir: o.runtimeDir, LogFile: o.logFile, A2A: cfg.A2A, TraceSize: cfg.Trace.Size, Client: cfg.Client, Getenv: os.Getenv}, stop).Register(gs)

	handleSignals(log, o.parentPID, abandon, func() { srv.DumpFlightRecord("SIGUSR1") })
	if o.parentPID > 0 {
		go watchParent(o.parentPID, abandon)
	}
	log.Info("serving", "version", version, "socket", o.socket, "peers", node.Addr(), "parent", o.parentPID, "spin", pcfg.Spin)
	err = gs.Serve(ln)
	os.Remove(o.socket)
	if errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return err
}

// prepare ties the process to its parent rank (if any), makes the runtime directory, names
// the control socket and opens the log.
func prepare(o *options, lc config.Log) (*slog.Logger, func(), error) {
	if o.parentPID > 0 {
		// Die with the rank that started us: the kernel signals us when it exits, and a
		// parent that is already gone is caught by the check right after.
		unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGTERM), 0, 0, 0)
		if os.Getppid() != o.parentPID {
			return nil, nil, fmt.Errorf("parent %d is gone", o.parentPID)
		}
	}
	if err := privateDir(o.runtimeDir); err != nil {
		return nil, nil, err
	}
	stale := removeStaleSockets(o.runtimeDir)
	if o.socket == "" {
		o.socket = filepath.Join(o.runtimeDir, fmt.Sprintf("pgserver-%d.sock", os.Getpid()))
	}
	log, closeLog, err := openLog(o.logFile, o.logLevel, lc)
	if err == nil && len(stale) > 0 {
		log.Info("removed the control sockets of sidecars that are gone", "paths", stale)
	}
	return log, closeLog, err
}

// defaultRuntimeDir is $XDG_RUNTIME_DIR/gocomm, else /tmp/gocomm-<uid>.
func defaultRuntimeDir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "gocomm")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("gocomm-%d", os.Getuid()))
}

// listenUnix creates the control socket readable and writable by this user only.
func listenUnix(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	old := unix.Umask(0o177)
	ln, err := net.Listen("unix", path)
	unix.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("control socket: %w", err)
	}
	return ln, nil
}

// listenFDSocket creates the fd socket (SOCK_SEQPACKET), for this user only.
func listenFDSocket(path string) (*net.UnixListener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("fd socket: %w", err)
	}
	old := unix.Umask(0o177)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	unix.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("fd socket: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("fd socket: %w", err)
	}
	return ln, nil
}

func openLog(path, level string, lc config.Log) (*slog.Logger, func(), error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(level)); err != nil {
		return nil, nil, fmt.Errorf("log level %q: %w", level, err)
	}
	var w io.Writer = os.Stderr
	closeFn := func() {}
	if path != "" {
		f, err := openRotating(path, lc.MaxBytes, lc.Keep)
		if err != nil {
			return nil, nil, err
		}
		w, closeFn = f, func() { f.Close() }
	}
	log := slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: lvl})).With("pid", os.Getpid())
	return log, closeFn, nil
}

// watchParent stops the server when the parent process is gone (backs up PDEATHSIG, which
// fires on the death of the parent's thread, not process).
func watchParent(pid int, stop func(string)) {
	for range time.Tick(200 * time.Millisecond) {
		if err := unix.Kill(pid, 0); errors.Is(err, unix.ESRCH) || os.Getppid() != pid {
			stop(fmt.Sprintf("the training process (pid %d) exited without leaving the group", pid))
			return
		}
	}
}

// engines wires in this node's implementations: the CUDA engine (where the driver loads),
// the sparse engine's chooser (from the GPU topology and the embedded a2av kernel) and the
// node's capabilities with their reasons.
func engines(log *slog.Logger, cfg config.Config, o options) (pg.Config, error) {
	var topo sparse.Topology
	t, topoErr := gonvml.Read(nvml.New())
	if topoErr != nil {
		log.Info("no GPU topology", "err", topoErr)
	} else {
		topo = t
	}
	_, kernelsErr := kernels.Cubin("a2av")
	chooser, err := sparse.NewChooser(topo, cfg.Transport, kernelsErr)
	if err != nil {
		return pg.Config{}, err
	}
	dev := device.New(log)
	cuda, _, _ := dev.Info()
	spin := spinFor(o, cfg.Spin, cuda)
	dev.Spin = spin
	hostname, _ := os.Hostname()
	facts := gonode.Describe(hostname, topo, topoErr, dev)
	log.Info("node capabilities", "facts", facts)
	dev.A2A = cfg.A2A
	dev.Ahead = cfg.Ahead
	return pg.Config{Version: version, Spin: spin, Device: dev, Sparse: chooser, Node: facts}, nil
}

// spinFor is how long the sidecar spins: --spin where given, else GOCOMM_SPIN, else (unset:
// config.SpinAuto) 2 ms where CUDA is available: GPU hosts have cores to spare, and polling
// saves the sidecar's wake-up on every op.
func spinFor(o options, knob time.Duration, cuda bool) time.Duration {
	switch {
	case o.spinSet:
		return o.spin
	case knob != config.SpinAuto:
		return knob
	case cuda:
		return 2 * time.Millisecond
	}
	return 0
}

// handleSignals stops on SIGTERM, SIGINT and SIGHUP (the parent rank's death arrives as
// SIGTERM, PDEATHSIG), and on SIGUSR1 dumps the flight record and logs every goroutine's
// stack, and goes on serving: what a hang is waiting for.
func handleSignals(log *slog.Logger, parent int, stop func(reason string), flight func()) {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	go func() {
		sig := <-sigs
		// PDEATHSIG comes as the parent's thread exits, before the parent is gone (a large
		// process takes a while to die): up to a second tells a dead parent from a signal
		// sent to pgserver
		for i := 0; parent > 0 && i < 200; i++ {
			if os.Getppid() != parent {
				stop(fmt.Sprintf("the training process (pid %d) died", parent))
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		stop(fmt.Sprintf("pgserver got signal %v", sig))
	}()
	dump := make(chan os.Signal, 1)
	signal.Notify(dump, syscall.SIGUSR1)
	go func() {
		for range dump {
			flight()
			var b strings.Builder
			pprof.Lookup("goroutine").WriteTo(&b, 2)
			log.Warn("goroutine dump (SIGUSR1)", "stacks", b.String())
		}
	}()
}

// traceFile names the flight record's dump for a rank: prefix plus the rank, as torch's
// TORCH_NCCL_DEBUG_INFO_TEMP_FILE; without a prefix, next to the log (its name with
// .trace.json for .log); with neither, none.
func traceFile(prefix, logFile string) func(rank int) string {
	return func(rank int) string {
		switch {
		case prefix != "":
			return fmt.Sprintf("%s%d", prefix, rank)
		case logFile != "":
			return strings.TrimSuffix(logFile, ".log") + ".trace.json"
		}
		return ""
	}
}

// shutdownGrace bounds how long an orderly shutdown lets in-flight rpcs finish.
const shutdownGrace = time.Second

// goTrace starts the Go runtime's execution trace and CPU profile (GOCOMM_GO_TRACE) into
// prefix + pid + .trace / .cpu; stop ends both and closes the files.
func goTrace(prefix string) (stop func(), err error) {
	base := fmt.Sprintf("%s%d", prefix, os.Getpid())
	tf, err := os.Create(base + ".trace")
	if err != nil {
		return nil, fmt.Errorf("GOCOMM_GO_TRACE: %w", err)
	}
	cf, err := os.Create(base + ".cpu")
	if err != nil {
		tf.Close()
		return nil, fmt.Errorf("GOCOMM_GO_TRACE: %w", err)
	}
	if err := pprof.StartCPUProfile(cf); err != nil {
		tf.Close()
		cf.Close()
		return nil, fmt.Errorf("GOCOMM_GO_TRACE: %w", err)
	}
	if err := trace.Start(tf); err != nil {
		pprof.StopCPUProfile()
		tf.Close()
		cf.Close()
		return nil, fmt.Errorf("GOCOMM_GO_TRACE: %w", err)
	}
	return func() {
		trace.Stop()
		pprof.StopCPUProfile()
		tf.Close()
		cf.Close()
	}, nil
}
