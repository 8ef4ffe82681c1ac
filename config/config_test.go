package config

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

// TestDefaults: with nothing set, the values the sidecar and the shim used before the table
// existed.
func TestDefaults(t *testing.T) {
	want := Config{
		Transport: "auto", A2A: A2A{RecvBytes: 512 << 20, Blocks: 128, Threads: 256, Direct: true},
		Peers: Peers{HandshakeTimeout: 5 * time.Second, HandshakesMax: 64, UnmatchedBytesMax: 1 << 30, DeadTimeout: 5 * time.Second},
		Log:   Log{MaxBytes: 64 << 20, Keep: 3},
		Trace: Trace{Size: 2000, OnFailure: true},
		Ahead: 32, LogLevel: "info", Spin: SpinAuto,
		Client: Client{CUDA: true, AsyncErrorHandling: 2, A2AVInProcess: true, MoELowLatencyBytes: 256 << 20,
			AllReduce: AllReduce{Max: 1 << 62, Stage: 32 << 20, OneShot: 256 << 10, Blocks: 128}},
	}
	if got := Defaults(); got != want {
		t.Fatalf("Defaults() = %+v, want %+v", got, want)
	}
}

func TestValues(t *testing.T) {
	for _, tc := range []struct {
		desc string
		env  map[string]string
		want func(c *Config) // what differs from Defaults()
	}{
		{"transport, any case and spaces", map[string]string{"GOCOMM_TRANSPORT": " NCCL "},
			func(c *Config) { c.Transport = "nccl" }},
		{"a2a settings", map[string]string{"GOCOMM_A2A_RECV_MB": "64", "GOCOMM_A2AV_BLOCKS": "2", "GOCOMM_A2AV_THREADS": "512", "GOCOMM_A2AV_DIRECT": "0"},
			func(c *Config) { c.A2A = A2A{RecvBytes: 64 << 20, Blocks: 2, Threads: 512} }},
		{"peers and log", map[string]string{"GOCOMM_HANDSHAKE_TIMEOUT": "2", "GOCOMM_PEER_HANDSHAKES_MAX": "8", "GOCOMM_UNMATCHED_BYTES_MAX": "1048576", "GOCOMM_LOG_MAX_MB": "1", "GOCOMM_LOG_KEEP": "0"},
			func(c *Config) {
				c.Peers.HandshakeTimeout, c.Peers.HandshakesMax, c.Peers.UnmatchedBytesMax = 2*time.Second, 8, 1<<20
				c.Log = Log{1 << 20, 0}
			}},
		{"dead peers and the flight recorder", map[string]string{"GOCOMM_PEER_DEAD_TIMEOUT_SEC": "1.5", "GOCOMM_TRACE_BUFFER_SIZE": "0", "GOCOMM_DEBUG_INFO_TEMP_FILE": "/tmp/t_", "GOCOMM_DUMP_ON_TIMEOUT": "0"},
			func(c *Config) { c.Peers.DeadTimeout, c.Trace = 1500*time.Millisecond, Trace{File: "/tmp/t_"} }},
		{"enqueue window", map[string]string{"GOCOMM_ENQUEUE_AHEAD": "4"}, func(c *Config) { c.Ahead = 4 }},
		{"empty is unset", map[string]string{"GOCOMM_A2AV_BLOCKS": " "}, func(*Config) {}},
		{"peer address", map[string]string{"GOCOMM_ADVERTISE_ADDR": "10.0.0.7", "GOCOMM_SOCKET_IFNAME": "ib0", "GOCOMM_LISTEN_ADDR": "0.0.0.0:0"},
			func(c *Config) { c.Peers.Advertise, c.Peers.Ifname, c.Peers.Listen = "10.0.0.7", "ib0", "0.0.0.0:0" }},
		{"log level, any case; spin", map[string]string{"GOCOMM_LOG_LEVEL": "DEBUG", "GOCOMM_SPIN": "500us"},
			func(c *Config) { c.LogLevel, c.Spin = "debug", 500*time.Microsecond }},
		{"spin 0 is none, not unset", map[string]string{"GOCOMM_SPIN": "0"}, func(c *Config) { c.Spin = 0 }},
		{"all_reduce sizes: suffixes, decimals, stage rounded down to 16", map[string]string{"GOCOMM_AR_MAX": "0", "GOCOMM_AR_STAGE": "1000", "GOCOMM_AR_ONESHOT": "1.5k", "GOCOMM_AR_BLOCKS": " 64 "},
			func(c *Config) { c.Client.AllReduce = AllReduce{Max: 0, Stage: 992, OneShot: 1536, Blocks: 64} }},
		{"all_reduce in G, stage in M", map[string]string{"GOCOMM_AR_MAX": "2G", "GOCOMM_AR_STAGE": "1M"},
			func(c *Config) { c.Client.AllReduce.Max, c.Client.AllReduce.Stage = 2<<30, 1<<20 }},
		{"client flags", map[string]string{"GOCOMM_CUDA": "0", "GOCOMM_A2AV_INPROCESS": "0", "GOCOMM_ASYNC_ERROR_HANDLING": "1"},
			func(c *Config) { c.Client.CUDA, c.Client.A2AVInProcess, c.Client.AsyncErrorHandling = false, false, 1 }},
	} {
		want := Defaults()
		tc.want(&want)
		got, warns, err := Load(env(tc.env))
		if err != nil || len(warns) != 0 || got != want {
			t.Errorf("%s: Load = %+v, %v, %v; want %+v", tc.desc, got, warns, err, want)
		}
	}
}

// TestBadValue: a value the table does not accept is an error naming the variable and what
// it accepts, never a silent default.
func TestBadValue(t *testing.T) {
	for _, tc := range []struct{ name, value, accepts string }{
		{"GOCOMM_TRANSPORT", "nvlink", "auto, nvshmem or nccl"},
		{"GOCOMM_A2A_RECV_MB", "0", "1 to 1048576"},
		{"GOCOMM_A2A_RECV_MB", "1.5", "1 to 1048576"},
		{"GOCOMM_NVSHMEM_RECV_MB", "-3", "1 to 1048576"},
		{"GOCOMM_A2AV_BLOCKS", "2000", "1 to 1024"},
		{"GOCOMM_A2AV_THREADS", "100", "a multiple of 32"},
		{"GOCOMM_A2AV_DIRECT", "yes", "0 or 1"},
		{"GOCOMM_PEER_DEAD_TIMEOUT_SEC", "0.1", "0.5 to 3600"},
		{"GOCOMM_PEER_DEAD_TIMEOUT_SEC", "5s", "0.5 to 3600"},
		{"GOCOMM_TRACE_BUFFER_SIZE", "-1", "0 to 1000000"},
		{"GOCOMM_DUMP_ON_TIMEOUT", "true", "0 or 1"},
		{"GOCOMM_LISTEN_ADDR", "0.0.0.0", "host:port"},
		{"GOCOMM_SOCKET_IFNAME", "eth0/1", "an interface name"},
		// a huge timeout is refused, not wrapped into a short one
		{"GOCOMM_HANDSHAKE_TIMEOUT", "9223372036854775807", "1 to 600"},
		{"GOCOMM_HANDSHAKE_TIMEOUT", "0", "1 to 600"},
		{"GOCOMM_PEER_HANDSHAKES_MAX", "1", "2 to 65536"},
		{"GOCOMM_UNMATCHED_BYTES_MAX", "99999999999999999999", "65536 to 2^50"},
		{"GOCOMM_LOG_MAX_MB", "0", "1 to 65536"},
		{"GOCOMM_LOG_LEVEL", "loud", "debug, info, warn or error"},
		{"GOCOMM_SPIN", "2", "a Go duration"},
		{"GOCOMM_SPIN", "-1ms", "a Go duration"},
		{"GOCOMM_SPIN", "2s", "up to 1s"},
		{"GOCOMM_CUDA", "no", "0 or 1"},
		{"GOCOMM_AR_MAX", "-1", "bytes, with K, M or G"},
		{"GOCOMM_AR_MAX", "1e9", "bytes, with K, M or G"},
		{"GOCOMM_AR_MAX", "9999999999G", "bytes, with K, M or G"}, // past 2^62: refused, not wrapped
		{"GOCOMM_AR_STAGE", "8", "at least 16"},
		{"GOCOMM_AR_STAGE", "32MB", "at least 16"},
		{"GOCOMM_AR_ONESHOT", "inf", "bytes, with K, M or G"},
		{"GOCOMM_AR_BLOCKS", "0", "1 to 128"},
		{"GOCOMM_AR_BLOCKS", "129", "1 to 128"},
		{"GOCOMM_A2AV_INPROCESS", "2", "0 or 1"},
		{"GOCOMM_A2AV_HERE", "2", "0 or 1"},
		{"GOCOMM_ASYNC_ERROR_HANDLING", "4", "0, 1, 2 or 3"},
	} {
		_, _, err := Load(env(map[string]string{tc.name: tc.value}))
		if err == nil || !strings.Contains(err.Error(), tc.name+"=") || !strings.Contains(err.Error(), tc.accepts) {
			t.Errorf("%s=%s: err %v, want one naming the variable and %q", tc.name, tc.value, err, tc.accepts)
		}
	}
}

// TestAlias: the old name of a renamed knob still works, with a warning; the new name wins.
func TestAlias(t *testing.T) {
	c, warns, err := Load(env(map[string]string{"GOCOMM_NVSHMEM_RECV_MB": "64"}))
	if err != nil || c.A2A.RecvBytes != 64<<20 {
		t.Fatalf("old name: %+v, %v", c, err)
	}
	if len(warns) != 1 || !strings.Contains(warns[0], "GOCOMM_NVSHMEM_RECV_MB") || !strings.Contains(warns[0], "GOCOMM_A2A_RECV_MB") {
		t.Fatalf("old name: warnings %q, want one naming both names", warns)
	}
	c, _, err = Load(env(map[string]string{"GOCOMM_NVSHMEM_RECV_MB": "64", "GOCOMM_A2A_RECV_MB": "32"}))
	if err != nil || c.A2A.RecvBytes != 32<<20 {
		t.Fatalf("both names: %+v, %v; want the new name's 32 MiB", c, err)
	}
	// the in-process all_to_all_v's knob before its rename
	c, warns, err = Load(env(map[string]string{"GOCOMM_A2AV_HERE": "0"}))
	if err != nil || c.Client.A2AVInProcess || len(warns) != 1 || !strings.Contains(warns[0], "GOCOMM_A2AV_HERE is deprecated: set GOCOMM_A2AV_INPROCESS") {
		t.Fatalf("GOCOMM_A2AV_HERE=0: %+v, %q, %v", c.Client, warns, err)
	}
}

// TestDocListsEveryKnob: docs/config.md has a row for every knob, with its default and its
// old names, so the page cannot drift from the table.
func TestDocListsEveryKnob(t *testing.T) {
	b, err := os.ReadFile("../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if m := regexp.MustCompile("^\\| `(GOCOMM_[A-Z0-9_]+)` \\|").FindStringSubmatch(line); m != nil {
			rows[m[1]] = line
		}
	}
	for _, p := range Params {
		row, ok := rows[p.Env]
		if !ok {
			t.Errorf("docs/config.md has no row for %s", p.Env)
			continue
		}
		want := "| `" + p.Default + "` |"
		if p.Default == "" { // as the shim's table writes an unset default
			want = "| (none) |"
		}
		if !strings.Contains(row, want) {
			t.Errorf("docs/config.md: %s's row does not give its default `%s`", p.Env, p.Default)
		}
		if !strings.Contains(row, "sidecar") {
			t.Errorf("docs/config.md: %s's row does not say the sidecar reads it", p.Env)
		}
		for _, a := range p.Aliases {
			if !strings.Contains(row, "`"+a+"`") {
				t.Errorf("docs/config.md: %s's row does not name its old name %s", p.Env, a)
			}
		}
	}
}

// TestNoGetenvOutsideConfig: GOCOMM_* variables are read here only (tests aside), so every
// knob has one default and one validation.
func TestNoGetenvOutsideConfig(t *testing.T) {
	read := regexp.MustCompile(`os\.(Getenv|LookupEnv)\(\s*"GOCOMM_`)
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != ".." && (strings.HasPrefix(name, ".") || name == "config" || name == "python") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if loc := read.FindIndex(b); loc != nil {
			line := 1 + strings.Count(string(b[:loc[0]]), "\n")
			t.Errorf("%s:%d reads a GOCOMM_ variable: add it to config.Params and pass the value down", path, line)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestClientDiffs: the knobs the client is told at Attach that a client's environment sets
// otherwise than the sidecar's, each named with both values (an old name too); a bad client
// value is named with what the table accepts; knobs only the sidecar uses, and equal values
// spelled otherwise, are not named.
func TestClientDiffs(t *testing.T) {
	sidecar := env(map[string]string{"GOCOMM_AR_MAX": "1M", "GOCOMM_SPIN": "0"})
	client := env(map[string]string{
		"GOCOMM_AR_MAX":            "2M",   // differs: named
		"GOCOMM_CUDA":              "0",    // differs from the default: named
		"GOCOMM_NVSHMEM_RECV_MB":   "64",   // the old name of GOCOMM_A2A_RECV_MB: named
		"GOCOMM_TRACE_BUFFER_SIZE": "2000", // the default, spelled out: the same
		"GOCOMM_SPIN":              "5ms",  // the sidecar's alone: not named
		"GOCOMM_AR_STAGE":          "lots", // not accepted: named
	})
	got := strings.Join(ClientDiffs(sidecar, client), "\n")
	for _, want := range []string{
		"GOCOMM_AR_MAX=2M in this process, GOCOMM_AR_MAX=1M in the sidecar, whose reading holds",
		"GOCOMM_CUDA=0 in this process, unset in the sidecar",
		"GOCOMM_NVSHMEM_RECV_MB=64 in this process, unset in the sidecar",
		"GOCOMM_AR_STAGE=lots in this process is not accepted (want ",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("ClientDiffs lacks %q; got:\n%s", want, got)
		}
	}
	if n := len(ClientDiffs(sidecar, client)); n != 4 {
		t.Errorf("%d lines, want 4:\n%s", n, got)
	}
	if d := ClientDiffs(sidecar, sidecar); len(d) != 0 {
		t.Errorf("the same environment differs: %v", d)
	}
}
