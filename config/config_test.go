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

// TestDefaults: with nothing set, the values the sidecar used before the table existed.
func TestDefaults(t *testing.T) {
	want := Config{
		Transport: "auto", A2A: A2A{RecvBytes: 512 << 20, Blocks: 128, Threads: 256, Direct: true},
		Peers: Peers{HandshakeTimeout: 5 * time.Second, HandshakesMax: 64, UnmatchedBytesMax: 1 << 30, DeadTimeout: 5 * time.Second},
		Log:   Log{MaxBytes: 64 << 20, Keep: 3},
		Trace: Trace{Size: 2000, OnFailure: true},
		Ahead: 32,
	}
	if got := Defaults(); got != want {
		t.Fatalf("Defaults() = %+v, want %+v", got, want)
	}
}

func TestValues(t *testing.T) {
	for _, tc := range []struct {
		desc string
		env  map[string]string
		want Config
	}{
		{"transport, any case and spaces", map[string]string{"GOCOMM_TRANSPORT": " NCCL "},
			Config{Transport: "nccl", A2A: Defaults().A2A, Peers: Defaults().Peers, Log: Defaults().Log, Trace: Defaults().Trace, Ahead: 32}},
		{"a2a settings", map[string]string{"GOCOMM_A2A_RECV_MB": "64", "GOCOMM_A2AV_BLOCKS": "2", "GOCOMM_A2AV_THREADS": "512", "GOCOMM_A2AV_DIRECT": "0"},
			Config{Transport: "auto", A2A: A2A{RecvBytes: 64 << 20, Blocks: 2, Threads: 512}, Peers: Defaults().Peers, Log: Defaults().Log, Trace: Defaults().Trace, Ahead: 32}},
		{"peers and log", map[string]string{"GOCOMM_HANDSHAKE_TIMEOUT": "2", "GOCOMM_PEER_HANDSHAKES_MAX": "8", "GOCOMM_UNMATCHED_BYTES_MAX": "1048576", "GOCOMM_LOG_MAX_MB": "1", "GOCOMM_LOG_KEEP": "0"},
			Config{Transport: "auto", A2A: Defaults().A2A, Peers: Peers{HandshakeTimeout: 2 * time.Second, HandshakesMax: 8, UnmatchedBytesMax: 1 << 20, DeadTimeout: 5 * time.Second}, Log: Log{1 << 20, 0}, Trace: Defaults().Trace, Ahead: 32}},
		{"dead peers and the flight recorder", map[string]string{"GOCOMM_PEER_DEAD_TIMEOUT_SEC": "1.5", "GOCOMM_TRACE_BUFFER_SIZE": "0", "GOCOMM_DEBUG_INFO_TEMP_FILE": "/tmp/t_", "GOCOMM_DUMP_ON_TIMEOUT": "0"},
			Config{Transport: "auto", A2A: Defaults().A2A, Peers: func() Peers {
				p := Defaults().Peers
				p.DeadTimeout = 1500 * time.Millisecond
				return p
			}(), Log: Defaults().Log, Trace: Trace{File: "/tmp/t_"}, Ahead: 32}},
		{"enqueue window", map[string]string{"GOCOMM_ENQUEUE_AHEAD": "4"},
			Config{Transport: "auto", A2A: Defaults().A2A, Peers: Defaults().Peers, Log: Defaults().Log, Trace: Defaults().Trace, Ahead: 4}},
		{"empty is unset", map[string]string{"GOCOMM_A2AV_BLOCKS": " "}, Defaults()},
		{"peer address", map[string]string{"GOCOMM_ADVERTISE_ADDR": "10.0.0.7", "GOCOMM_SOCKET_IFNAME": "ib0", "GOCOMM_LISTEN_ADDR": "0.0.0.0:0"},
			Config{Transport: "auto", A2A: Defaults().A2A, Peers: func() Peers {
				p := Defaults().Peers
				p.Advertise, p.Ifname, p.Listen = "10.0.0.7", "ib0", "0.0.0.0:0"
				return p
			}(), Log: Defaults().Log, Trace: Defaults().Trace, Ahead: 32}},
	} {
		got, warns, err := Load(env(tc.env))
		if err != nil || len(warns) != 0 || got != tc.want {
			t.Errorf("%s: Load = %+v, %v, %v; want %+v", tc.desc, got, warns, err, tc.want)
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
