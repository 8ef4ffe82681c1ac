// Package config is the sidecar's knob table: every GOCOMM_* variable pgserver reads, with
// its default, the values it accepts and what it means, in the manner of NCCL's
// NCCL_PARAM(Name, "ENV", default). cmd/pgserver reads the table once at start (Load) and
// hands the typed values down; no other package reads GOCOMM_* variables, and a value the
// table does not accept stops the sidecar with an error naming the variable.
//
// The training process's knobs are read here too (Client, and the sparse all-to-all's A2A,
// which both sides use): the sidecar reports them in its Attach response and the Python shim
// takes them from there, so one table parses every knob. The shim's own table
// (python/gocomm/_config.py) holds only what it needs before a sidecar answers: where
// pgserver is, or which running one to attach to, where it logs, how long to wait for it.
// docs/config.md lists both tables; a test keeps it in step with this one.
//
// Environment that is not gocomm's stays where the library that needs it is: NVSHMEM_HOME
// (internal/nvshmem, collectives/device: where libnvshmem_host is), the NVSHMEM_* variables
// collectives/device sets for NVSHMEM where the user did not, and XDG_RUNTIME_DIR
// (cmd/pgserver: the default runtime directory).
package config

import (
	"fmt"
	"net"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Config is the sidecar's settings, as read from the environment.
type Config struct {
	// Transport is GOCOMM_TRANSPORT: "auto", "nvshmem" or "nccl".
	Transport string
	A2A       A2A
	Peers     Peers
	Log       Log
	Trace     Trace
	// Ahead is GOCOMM_ENQUEUE_AHEAD: the most ops a device worker keeps enqueued on its
	// stream that the GPU has not finished (see collectives/device, group design 8).
	Ahead int
	// LogLevel is GOCOMM_LOG_LEVEL: "debug", "info", "warn" or "error".
	LogLevel string
	// Spin is GOCOMM_SPIN: how long the sidecar polls its ring (and its device workers
	// their queues, its graph watcher after a replay) before sleeping; SpinAuto where unset.
	Spin   time.Duration
	Client Client
}

// SpinAuto is Config.Spin where GOCOMM_SPIN is unset: 2 ms where CUDA is available (GPU
// hosts have cores to spare, and polling saves a wake-up per op), else no spinning.
const SpinAuto time.Duration = -1

// MaxSpin is the longest GOCOMM_SPIN (and --spin) accepted.
const MaxSpin = time.Second

// Client is the training process's side (the shim and its compiled client): knobs it needs
// only once a sidecar answers, so the sidecar reads them and reports them at Attach.
type Client struct {
	// CUDA is GOCOMM_CUDA: false refuses CUDA tensors before anything is sent.
	CUDA bool
	// AsyncErrorHandling is GOCOMM_ASYNC_ERROR_HANDLING, 0 to 3, as torch's
	// TORCH_NCCL_ASYNC_ERROR_HANDLING: 1 and 3 end the process when a group breaks.
	AsyncErrorHandling int
	AllReduce          AllReduce
	// A2AVInProcess is GOCOMM_A2AV_INPROCESS: all_to_all_v with splits on the GPU runs the
	// in-process kernel where it can, else the sidecar's NVSHMEM kernel.
	A2AVInProcess bool
	// MoELowLatencyBytes is GOCOMM_MOE_LL_MB in bytes: the most a group's low-latency MoE
	// buffer may take on a GPU where padded dispatch sets it up by itself; 0: padded dispatch
	// keeps its three-launch kernels unless a call asks for low_latency.
	MoELowLatencyBytes int64
}

// AllReduce shapes the in-process all_reduce kernel (csrc/client/inprocess.h). The same on
// every rank: the kernel's setup compares them.
type AllReduce struct {
	// Max is the largest message it takes: 0 turns it off, AnySize (GOCOMM_AR_MAX unset)
	// is no limit.
	Max int64
	// Stage is the bytes of a message per two-shot round, a multiple of 16.
	Stage int64
	// OneShot is the size up to which it is one-shot.
	OneShot int64
	// Blocks is the most blocks it uses.
	Blocks int
}

// AnySize is AllReduce.Max where GOCOMM_AR_MAX is unset, and the most any size knob takes.
const AnySize = 1 << 62

// Peers is where peer sidecars reach this one (transport.ChooseAddress picks the address
// from Advertise, Ifname, the rendezvous host the shim passes, and the routing table) and what
// the sidecar grants the sidecars that dial it.
type Peers struct {
	// Advertise is GOCOMM_ADVERTISE_ADDR: the address to listen on and advertise ("": chosen).
	Advertise string
	// Ifname is GOCOMM_SOCKET_IFNAME: advertise this interface's address.
	Ifname string
	// Listen is GOCOMM_LISTEN_ADDR: listen here instead of on the advertised address.
	Listen string
	// HandshakeTimeout bounds a link's handshake, accepted or dialed.
	HandshakeTimeout time.Duration
	// HandshakesMax caps the accepted links that have not proved they hold a group's secret.
	HandshakesMax int
	// UnmatchedBytesMax caps the bytes one peer's messages that no receive matched yet may
	// hold in this sidecar, per group.
	UnmatchedBytesMax int64
	// DeadTimeout is GOCOMM_PEER_DEAD_TIMEOUT_SEC: how long a peer may stay silent (no
	// frame, not even a heartbeat) before every rank's group breaks naming it.
	DeadTimeout time.Duration
}

// Log is how the sidecar's log file is kept.
type Log struct {
	// MaxBytes is the size past which the log file is rotated; Keep is how many rotated
	// files are kept (<log>.1 the newest).
	MaxBytes int64
	Keep     int
}

// Trace is the flight recorder's setting: the last ops of each group, dumped when a group
// breaks, on SIGUSR1 and on request (torch's TORCH_NCCL_TRACE_BUFFER_SIZE and friends).
type Trace struct {
	// Size is the ops kept per group; 0 turns the recorder off.
	Size int
	// File is where a dump's JSON goes: this path followed by the rank (as torch's
	// TORCH_NCCL_DEBUG_INFO_TEMP_FILE); "" puts it next to the log.
	File string
	// OnFailure: dump when a group breaks (a timeout, a lost peer, an abort).
	OnFailure bool
	// GoTrace is GOCOMM_GO_TRACE: where pgserver writes the Go runtime's execution trace and
	// CPU profile of its whole life ("" for none), to see where a sidecar's microseconds go.
	GoTrace string
}

// A2A is how the sparse all-to-all (all_to_all_v with its splits on the GPU) is sized and
// launched, by the sidecar's NVSHMEM kernel and by the shim's in-process kernel alike.
type A2A struct {
	// RecvBytes is the receive buffer per GPU: the most one all_to_all_v delivers to a rank
	// on the NVSHMEM kernel.
	RecvBytes int64
	// Blocks is the kernels' blocks in all, split evenly over the destinations (at least one
	// each); Threads is their threads per block (a multiple of 32).
	Blocks, Threads int
	// Direct: the NVSHMEM kernel writes NVLink peers with its own stores rather than
	// NVSHMEM's block put.
	Direct bool
}

// Param is one knob of the table.
type Param struct {
	Env     string   // the variable
	Aliases []string // older names, still read (with a warning) when Env is unset
	Default string   // the value taken when the variable is unset or empty
	Accepts string   // what a value may be, for errors and docs/config.md
	Doc     string
	set     func(c *Config, v string) error
}

// Params is the table, in the order docs/config.md lists it.
var Params = []Param{
	{
		Env: "GOCOMM_TRANSPORT", Default: "auto", Accepts: "auto, nvshmem or nccl",
		Doc: "the sparse all-to-all transport; auto takes NVSHMEM where every pair of the node's GPUs shares NVLink with peer atomics and the library loads, else NCCL",
		set: func(c *Config, v string) error {
			switch v = strings.ToLower(v); v {
			case "auto", "nvshmem", "nccl":
				c.Transport = v
				return nil
			}
			return errAccepts
		},
	},
	{
		Env: "GOCOMM_A2A_RECV_MB", Aliases: []string{"GOCOMM_NVSHMEM_RECV_MB"}, Default: "512",
		Accepts: "an integer of MiB, 1 to 1048576",
		Doc:     "the sparse all-to-all's receive buffer per GPU, in MiB: the sidecar's NVSHMEM kernel keeps it in the symmetric heap (the most one all_to_all_v delivers to a rank there), the shim's kernel allocates it per group and GPU",
		set:     func(c *Config, v string) error { return mib(v, 1, 1<<20, &c.A2A.RecvBytes) },
	},
	{
		Env: "GOCOMM_A2AV_BLOCKS", Default: "128", Accepts: "an integer, 1 to 1024",
		Doc: "the sparse all-to-all kernels' blocks in all, split evenly over the destinations (at least one each); all must fit on the GPU at once. The same on every rank",
		set: func(c *Config, v string) (err error) {
			c.A2A.Blocks, err = intIn(v, 1, 1024)
			return err
		},
	},
	{
		Env: "GOCOMM_A2AV_THREADS", Default: "256", Accepts: "a multiple of 32, 32 to 512",
		Doc: "the sparse all-to-all kernels' threads per block (the NVSHMEM kernel uses 76 registers a thread on sm_90, too many for 1024). The same on every rank",
		set: func(c *Config, v string) (err error) {
			c.A2A.Threads, err = intIn(v, 32, 512)
			if err == nil && c.A2A.Threads%32 != 0 {
				err = errAccepts
			}
			return err
		},
	},
	{
		Env: "GOCOMM_A2AV_DIRECT", Default: "1", Accepts: "0 or 1",
		Doc: "1: the sidecar's NVSHMEM kernel writes NVLink peers with its own stores; 0: with NVSHMEM's block put (for measurements). The same on every rank",
		set: func(c *Config, v string) error { return flag(v, &c.A2A.Direct) },
	},
	{
		Env: "GOCOMM_ADVERTISE_ADDR", Accepts: "a host name or address of this host",
		Doc: "the address this sidecar listens on and its peers dial (unset: GOCOMM_SOCKET_IFNAME's, else the local address of the route to the torch Store's host, loopback where every rank is on this host)",
		set: func(c *Config, v string) error {
			if strings.ContainsAny(v, " /") {
				return errAccepts
			}
			c.Peers.Advertise = v
			return nil
		},
	},
	{
		Env: "GOCOMM_HANDSHAKE_TIMEOUT", Default: "5", Accepts: "an integer of seconds, 1 to 600",
		Doc: "how long a peer link's handshake may take; a connection that has not proved it holds the group's secret by then is closed",
		set: func(c *Config, v string) error {
			n, err := intIn(v, 1, 600)
			c.Peers.HandshakeTimeout = time.Duration(n) * time.Second
			return err
		},
	},
	{
		Env: "GOCOMM_PEER_HANDSHAKES_MAX", Default: "64", Accepts: "an integer, 2 to 65536",
		Doc: "the most peer connections in their handshake (not yet authenticated) at once; a new one past it closes the oldest, which a real peer retries",
		set: func(c *Config, v string) (err error) {
			c.Peers.HandshakesMax, err = intIn(v, 2, 1<<16)
			return err
		},
	},
	{
		Env: "GOCOMM_UNMATCHED_BYTES_MAX", Default: "1073741824", Accepts: "an integer of bytes, 65536 to 2^50",
		Doc: "the most bytes one peer's messages that no receive matched yet may hold in the sidecar, per group; a peer that sends more breaks the group with an error naming this knob",
		set: func(c *Config, v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 1<<16 || n > 1<<50 {
				return errAccepts
			}
			c.Peers.UnmatchedBytesMax = n
			return nil
		},
	},
	{
		Env: "GOCOMM_SOCKET_IFNAME", Accepts: "an interface name",
		Doc: "advertise this interface's address (its first IPv4, else IPv6), as NCCL_SOCKET_IFNAME names one",
		set: func(c *Config, v string) error {
			if len(v) > 15 || strings.ContainsAny(v, " /") {
				return errAccepts
			}
			c.Peers.Ifname = v
			return nil
		},
	},
	{
		Env: "GOCOMM_LISTEN_ADDR", Accepts: "host:port (0.0.0.0:0 for every interface)",
		Doc: "where the sidecar listens for peers when that is not the advertised address (NAT, port mapping); unset: the advertised address, a port the system picks",
		set: func(c *Config, v string) error {
			if v != "" {
				if _, _, err := net.SplitHostPort(v); err != nil {
					return errAccepts
				}
			}
			c.Peers.Listen = v
			return nil
		},
	},
	{
		Env: "GOCOMM_LOG_MAX_MB", Default: "64", Accepts: "an integer of MiB, 1 to 65536",
		Doc: "the size at which the sidecar's log file is rotated (to <log>.1, the older ones shifted)",
		set: func(c *Config, v string) error { return mib(v, 1, 1<<16, &c.Log.MaxBytes) },
	},
	{
		Env: "GOCOMM_LOG_KEEP", Default: "3", Accepts: "an integer, 0 to 100",
		Doc: "how many rotated log files the sidecar keeps (<log>.1 to <log>.N); 0 keeps none",
		set: func(c *Config, v string) (err error) {
			c.Log.Keep, err = intIn(v, 0, 100)
			return err
		},
	},
	{
		Env: "GOCOMM_PEER_DEAD_TIMEOUT_SEC", Default: "5", Accepts: "seconds, 0.5 to 3600",
		Doc: "the most a dead or silent peer holds up the others: idle links carry a heartbeat at a fifth of it, a link that carries nothing for four fifths of it (or takes none of this side's bytes for all of it) breaks the group on every rank, naming the peer, and a refused dial is retried for a quarter of it. No torch counterpart (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC is torch's watchdog's own heartbeat)",
		set: func(c *Config, v string) error {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || !(f >= 0.5 && f <= 3600) {
				return errAccepts
			}
			c.Peers.DeadTimeout = time.Duration(f * float64(time.Second))
			return nil
		},
	},
	{
		Env: "GOCOMM_TRACE_BUFFER_SIZE", Default: "2000", Accepts: "an integer, 0 to 1000000",
		Doc: "the flight recorder: how many of the last ops each group keeps (0: off), as TORCH_NCCL_TRACE_BUFFER_SIZE",
		set: func(c *Config, v string) (err error) {
			c.Trace.Size, err = intIn(v, 0, 1000000)
			return err
		},
	},
	{
		Env: "GOCOMM_ENQUEUE_AHEAD", Default: "32", Accepts: "an integer, 1 to 4096",
		Doc: "how many ops each of the sidecar's device streams (the collective one, each point-to-point peer and direction) holds enqueued ahead of the GPU; a stream enqueued without bound fills the driver's queue, and a blocked enqueue then holds up the ops of other streams that the queued ones wait for",
		set: func(c *Config, v string) (err error) {
			c.Ahead, err = intIn(v, 1, 4096)
			return err
		},
	},
	{
		Env: "GOCOMM_DEBUG_INFO_TEMP_FILE", Default: "", Accepts: "a path prefix",
		Doc: "where the flight recorder's JSON dump goes: this prefix followed by the rank, as TORCH_NCCL_DEBUG_INFO_TEMP_FILE (unset: next to the sidecar's log, its name with .trace.json for .log)",
		set: func(c *Config, v string) error {
			c.Trace.File = v
			return nil
		},
	},
	{
		Env: "GOCOMM_GO_TRACE", Default: "", Accepts: "a path prefix",
		Doc: "debugging the sidecar's latency: pgserver writes the Go runtime's execution trace (go tool trace) to this prefix followed by its pid and .trace, and its CPU profile to the same with .cpu, from start to exit (large: minutes fill gigabytes)",
		set: func(c *Config, v string) error {
			c.Trace.GoTrace = v
			return nil
		},
	},
	{
		Env: "GOCOMM_DUMP_ON_TIMEOUT", Default: "1", Accepts: "0 or 1",
		Doc: "1: dump the flight recorder (log and JSON file) when a group breaks: an op timed out, a peer was lost or aborted, as TORCH_NCCL_DUMP_ON_TIMEOUT",
		set: func(c *Config, v string) error {
			return flag(v, &c.Trace.OnFailure)
		},
	},
	{
		Env: "GOCOMM_LOG_LEVEL", Default: "info", Accepts: "debug, info, warn or error",
		Doc: "how much the sidecar logs (a --log-level flag wins)",
		set: func(c *Config, v string) error {
			switch v = strings.ToLower(v); v {
			case "debug", "info", "warn", "error":
				c.LogLevel = v
				return nil
			}
			return errAccepts
		},
	},
	{
		Env: "GOCOMM_SPIN", Accepts: "a Go duration up to 1s (2ms, 500us) or 0",
		Doc: "how long the sidecar polls its ring before sleeping, and its CUDA graph watcher after a replay (unset: 2ms where CUDA is available, else none; a --spin flag wins)",
		set: func(c *Config, v string) error {
			if v == "" {
				c.Spin = SpinAuto
				return nil
			}
			// a spinning sidecar holds a core: past a second it would hold one for good
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 || d > MaxSpin {
				return errAccepts
			}
			c.Spin = d
			return nil
		},
	},
	{
		Env: "GOCOMM_CUDA", Default: "1", Accepts: "0 or 1",
		Doc: "0 turns the client's CUDA engine off: CUDA tensors raise before anything is sent",
		set: func(c *Config, v string) error { return flag(v, &c.Client.CUDA) },
	},
	{
		Env: "GOCOMM_AR_MAX", Accepts: "bytes, with K, M or G",
		Doc: "the largest message the in-process all_reduce kernel takes (unset: any; 0 turns it off). The same on every rank",
		set: func(c *Config, v string) (err error) {
			if v == "" {
				c.Client.AllReduce.Max = AnySize
				return nil
			}
			c.Client.AllReduce.Max, err = size(v, 0)
			return err
		},
	},
	{
		Env: "GOCOMM_AR_STAGE", Default: "32M", Accepts: "bytes, at least 16, with K, M or G",
		Doc: "bytes of the message per two-shot round of the in-process all_reduce (rounded down to a multiple of 16); it allocates four times this per group and GPU. The same on every rank",
		set: func(c *Config, v string) error {
			n, err := size(v, 16)
			c.Client.AllReduce.Stage = n / 16 * 16
			return err
		},
	},
	{
		Env: "GOCOMM_AR_ONESHOT", Default: "256K", Accepts: "bytes, with K, M or G",
		Doc: "the size up to which the in-process all_reduce is one-shot. The same on every rank",
		set: func(c *Config, v string) (err error) {
			c.Client.AllReduce.OneShot, err = size(v, 0)
			return err
		},
	},
	{
		Env: "GOCOMM_AR_BLOCKS", Default: "128", Accepts: "an integer, 1 to 128",
		Doc: "the most blocks the in-process all_reduce kernel uses. The same on every rank",
		set: func(c *Config, v string) (err error) {
			c.Client.AllReduce.Blocks, err = intIn(v, 1, 128)
			return err
		},
	},
	{
		Env: "GOCOMM_A2AV_INPROCESS", Aliases: []string{"GOCOMM_A2AV_HERE"}, Default: "1", Accepts: "0 or 1",
		Doc: "all_to_all_v with splits on the GPU: 1 runs the in-process kernel where it can, 0 leaves it to the sidecar's NVSHMEM kernel. The same on every rank",
		set: func(c *Config, v string) error { return flag(v, &c.Client.A2AVInProcess) },
	},
	{
		Env: "GOCOMM_MOE_LL_MB", Default: "256", Accepts: "an integer of MiB, 0 to 1048576",
		Doc: "the most memory, per group and GPU, that padded MoE dispatch may give the one-launch (low-latency) kernels' buffer when it sets it up by itself, at its first call where the group's exchange runs in this process and no two of its ranks share a GPU; 0 keeps padded dispatch on its three-launch kernels unless a call passes low_latency=True. The same on every rank",
		set: func(c *Config, v string) error { return mib(v, 0, 1<<20, &c.Client.MoELowLatencyBytes) },
	},
	{
		Env: "GOCOMM_ASYNC_ERROR_HANDLING", Default: "2", Accepts: "0, 1, 2 or 3",
		Doc: "what a group that breaks does to the process, as TORCH_NCCL_ASYNC_ERROR_HANDLING: 0 and 2 raise from the next wait() or call on the group (the sidecar aborts the group either way); 1 and 3 end the process (SIGABRT) as soon as the sidecar reports the break",
		set: func(c *Config, v string) (err error) {
			c.Client.AsyncErrorHandling, err = intIn(v, 0, 3)
			return err
		},
	},
}

// errAccepts stands for "not one of the values Param.Accepts names"; Load words the error.
var errAccepts = fmt.Errorf("not accepted")

// mib sets *to to v MiB (in bytes), v an integer in [lo, hi].
func mib(v string, lo, hi int, to *int64) error {
	n, err := intIn(v, lo, hi)
	*to = int64(n) << 20
	return err
}

func intIn(v string, lo, hi int) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		return 0, errAccepts
	}
	return n, nil
}

func flag(v string, to *bool) error {
	if v != "0" && v != "1" {
		return errAccepts
	}
	*to = v == "1"
	return nil
}

var sizeSyntax = regexp.MustCompile(`^(\d+(\.\d*)?|\.\d+)([KMGkmg]?)$`)

// size is bytes, an integer or decimal with an optional K, M or G (powers of 1024), at
// least lo and at most AnySize.
func size(v string, lo int64) (int64, error) {
	m := sizeSyntax.FindStringSubmatch(v)
	if m == nil {
		return 0, errAccepts
	}
	f, err := strconv.ParseFloat(m[1], 64)
	f *= float64(map[string]int64{"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[strings.ToUpper(m[3])])
	if err != nil || f < float64(lo) || f > AnySize {
		return 0, errAccepts
	}
	return int64(f), nil
}

// Load reads every knob through getenv (os.Getenv in pgserver). It returns the settings,
// one warning for each deprecated name that was read, and an error naming every variable
// whose value the table does not accept.
func Load(getenv func(string) string) (Config, []string, error) {
	var c Config
	var warnings, bad []string
	for _, p := range Params {
		name, v := p.Env, strings.TrimSpace(getenv(p.Env))
		for _, old := range p.Aliases {
			if ov := strings.TrimSpace(getenv(old)); v == "" && ov != "" {
				name, v = old, ov
				warnings = append(warnings, fmt.Sprintf("%s is deprecated: set %s instead", old, p.Env))
			}
		}
		if v == "" {
			v = p.Default
		}
		if err := p.set(&c, v); err != nil {
			bad = append(bad, fmt.Sprintf("%s=%q: want %s", name, v, p.Accepts))
		}
	}
	if len(bad) > 0 {
		return Config{}, warnings, fmt.Errorf("environment: %s", strings.Join(bad, "; "))
	}
	return c, warnings, nil
}

// ClientDiffs names each knob the training process uses (what Attach reports: Client, A2A,
// Trace.Size) that the environment client sets otherwise than sidecar does, and each client
// value the table does not accept, one line each: a training process attached to a sidecar
// started apart (GOCOMM_SIDECAR) runs with the sidecar's reading, not its own. A variable
// counts when taking the client's value for it alone changes what the client is told.
func ClientDiffs(sidecar, client func(string) string) []string {
	mine, _, err := Load(sidecar)
	if err != nil {
		return nil
	}
	type view struct { // what Attach reports (comparable: a field that is not fails to build)
		client Client
		a2a    A2A
		trace  int
	}
	told := func(c Config) view { return view{c.Client, c.A2A, c.Trace.Size} }
	var out []string
	for _, p := range Params {
		names := append([]string{p.Env}, p.Aliases...)
		theirs, _, err := Load(func(k string) string {
			for _, n := range names {
				if k == n {
					return client(k)
				}
			}
			return sidecar(k)
		})
		if err == nil && told(theirs) == told(mine) {
			continue
		}
		show := func(getenv func(string) string) string {
			for _, n := range names {
				if v := strings.TrimSpace(getenv(n)); v != "" {
					return n + "=" + v
				}
			}
			return "unset"
		}
		if err != nil {
			out = append(out, fmt.Sprintf("%s in this process is not accepted (want %s); the sidecar's reading (%s) holds",
				show(client), p.Accepts, show(sidecar)))
			continue
		}
		out = append(out, fmt.Sprintf("%s in this process, %s in the sidecar, whose reading holds", show(client),
			show(sidecar)))
	}
	return out
}

// FromEnv is Load of this process's environment.
func FromEnv() (Config, []string, error) { return Load(os.Getenv) }

// Defaults is the settings with every variable unset.
func Defaults() Config {
	c, _, err := Load(func(string) string { return "" })
	if err != nil {
		panic("config: a default is not accepted: " + err.Error())
	}
	return c
}
