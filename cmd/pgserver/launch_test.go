package main

import (
	"bytes"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// fakeMPS puts a stand-in for nvidia-cuda-mps-control in dir: `-d` starts "the daemon" of
// the pipe directory in the environment (a state file per pipe), get_server_list answers 0
// where that daemon is up, quit stops it; every call is logged with its pipe directory.
// up lists the pipes whose daemons run already ("" for NVIDIA's default).
func fakeMPS(t *testing.T, up ...string) (logFile string) {
	t.Helper()
	dir := t.TempDir()
	logFile = filepath.Join(dir, "calls")
	state := func(pipe string) string { return logFile + ".up" + strings.ReplaceAll(pipe, "/", "_") }
	for _, p := range up {
		if err := os.WriteFile(state(p), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	script := `#!/bin/sh
in=$(cat -)
echo "$* $in|$CUDA_MPS_PIPE_DIRECTORY" >> ` + logFile + `
up=` + logFile + `.up$(echo "$CUDA_MPS_PIPE_DIRECTORY" | tr / _)
case "$* $in" in
  -d*) touch "$up" ;;
  *quit*) rm -f "$up" ;;
  *) [ -e "$up" ] || { echo "Cannot find MPS control daemon process"; exit 1; } ;;
esac
`
	exe := filepath.Join(dir, "nvidia-cuda-mps-control")
	if err := os.WriteFile(exe, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	old := mpsControl
	mpsControl = exe
	t.Cleanup(func() { mpsControl = old })
	return logFile
}

func calls(t *testing.T, logFile string) []string {
	b, err := os.ReadFile(logFile)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

func TestMPSWhere(t *testing.T) {
	own := filepath.Join(os.TempDir(), "gocomm-mps-"+strconv.Itoa(os.Getuid()))
	env := func(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }
	yes := func([]string) bool { return true }
	no := func([]string) bool { return false }
	for _, c := range []struct {
		name    string
		dir     string
		env     map[string]string
		answers func([]string) bool
		want    mpsPlace
	}{
		{"--mps-dir wins over the environment", "/d", map[string]string{"CUDA_MPS_PIPE_DIRECTORY": "/e"}, yes,
			mpsPlace{"/d/pipe", "/d/log", []string{"CUDA_MPS_PIPE_DIRECTORY=/d/pipe", "CUDA_MPS_LOG_DIRECTORY=/d/log"}}},
		{"the environment's pipe, a log of ours", "", map[string]string{"CUDA_MPS_PIPE_DIRECTORY": "/e"}, yes,
			mpsPlace{"/e", own + "/log", []string{"CUDA_MPS_LOG_DIRECTORY=" + own + "/log"}}},
		{"a daemon on NVIDIA's default pipe is used as it is", "", nil, yes, mpsPlace{nvidiaPipe, "", nil}},
		{"none: a directory of ours", "", nil, no,
			mpsPlace{own + "/pipe", own + "/log", []string{"CUDA_MPS_PIPE_DIRECTORY=" + own + "/pipe", "CUDA_MPS_LOG_DIRECTORY=" + own + "/log"}}},
	} {
		got := mpsWhere(c.dir, env(c.env), c.answers)
		if got.pipe != c.want.pipe || got.log != c.want.log || !slices.Equal(got.env, c.want.env) {
			t.Errorf("%s: got %+v, want %+v", c.name, got, c.want)
		}
	}
}

// TestLaunchExitStatus: launch returns the job's status, -n where signal n ended it (the
// launcher then ends by that signal, or exits 128+n: endAsJob).
func TestLaunchExitStatus(t *testing.T) {
	t.Setenv("CUDA_MPS_PIPE_DIRECTORY", t.TempDir())
	fakeMPS(t)
	for script, want := range map[string]int{"exit 0": 0, "exit 3": 3, "kill -9 $$": -9, "kill -TERM $$": -15} {
		var stderr bytes.Buffer
		code, err := launch([]string{"--run", "--", "sh", "-c", script}, &stderr)
		if err != nil || code != want {
			t.Errorf("%q: status %d, %v; want %d (%s)", script, code, err, want, stderr.String())
		}
		if !strings.Contains(stderr.String(), "no MPS daemon") {
			t.Errorf("%q: no word of the missing MPS daemon: %s", script, stderr.String())
		}
	}
	code, err := launch([]string{"--run", "--", "/nonexistent/job"}, &bytes.Buffer{})
	if code != 127 || err == nil || !strings.Contains(err.Error(), "/nonexistent/job") {
		t.Errorf("a job that cannot start: status %d, %v", code, err)
	}
	if code, err := launch([]string{"--mps"}, &bytes.Buffer{}); code != 2 || err == nil {
		t.Errorf("no job: status %d, %v", code, err)
	}
	if got := endAsJob(-int(syscall.SIGSEGV)); got != 128+int(syscall.SIGSEGV) {
		t.Errorf("a job's SIGSEGV: %d, want 139 (and no core of the launcher)", got)
	}
}

// TestPassOn: which signal the job gets for each the launcher gets.
func TestPassOn(t *testing.T) {
	for _, c := range []struct {
		name    string
		sig     syscall.Signal
		run     bool
		handles string
		ending  int
		ours    bool
		want    syscall.Signal
	}{
		{"SIGTERM to torchrun", syscall.SIGTERM, false, "", 0, false, syscall.SIGTERM},
		{"a second SIGTERM to torchrun: not SIGKILL, which would orphan its workers", syscall.SIGTERM, false, "", 1, false, syscall.SIGTERM},
		{"Ctrl-C from our terminal reached the job already", syscall.SIGINT, false, "", 0, true, 0},
		{"SIGINT with no terminal of ours", syscall.SIGINT, false, "", 0, false, syscall.SIGINT},
		{"SIGTERM while our group has the terminal", syscall.SIGTERM, true, "", 0, true, syscall.SIGTERM},
		{"SIGUSR1: torchrun would die of it alone", syscall.SIGUSR1, false, "SIGTERM,SIGINT", 0, false, 0},
		{"SIGUSR1 that torchrun handles", syscall.SIGUSR1, false, "SIGTERM,SIGUSR1", 0, false, syscall.SIGUSR1},
		{"SIGUSR2 to a command", syscall.SIGUSR2, true, "", 0, false, syscall.SIGUSR2},
		{"a second SIGTERM to a command", syscall.SIGTERM, true, "", 1, false, syscall.SIGKILL},
		{"a first SIGHUP to a command", syscall.SIGHUP, true, "", 0, false, syscall.SIGHUP},
	} {
		if got := passOn(c.sig, c.run, c.handles, c.ending, c.ours); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

// TestLaunchKeepsIgnoredSignals: a signal ignored where the launcher started (nohup) stays
// ignored in the job, as without the launcher.
func TestLaunchKeepsIgnoredSignals(t *testing.T) {
	t.Setenv("CUDA_MPS_PIPE_DIRECTORY", t.TempDir())
	fakeMPS(t)
	signal.Ignore(syscall.SIGHUP)
	defer signal.Reset(syscall.SIGHUP)
	code, err := launch([]string{"--run", "--", "sh", "-c", "kill -HUP $$; exit 5"}, &bytes.Buffer{})
	if code != 5 || err != nil {
		t.Fatalf("status %d, %v; want the job's 5 (SIGHUP ignored as the launcher found it)", code, err)
	}
}

// TestLaunchSignalWhileMPSStarts: a SIGTERM while the daemon starts stops it and starts no job.
func TestLaunchSignalWhileMPSStarts(t *testing.T) {
	logFile := fakeMPS(t)
	slow := filepath.Join(t.TempDir(), "nvidia-cuda-mps-control")
	os.WriteFile(slow, []byte("#!/bin/sh\ncase \"$*\" in -d*) sleep 0.5 ;; esac\nexec "+mpsControl+" \"$@\"\n"), 0o700)
	mpsControl = slow
	dir, ran := t.TempDir(), filepath.Join(t.TempDir(), "ran")
	go func() {
		time.Sleep(200 * time.Millisecond)
		syscall.Kill(os.Getpid(), syscall.SIGTERM)
	}()
	var stderr bytes.Buffer
	code, err := launch([]string{"--mps", "--mps-dir", dir, "--run", "--", "touch", ran}, &stderr)
	if code != -int(syscall.SIGTERM) || err != nil {
		t.Fatalf("status %d, %v; want -15 (%s)", code, err, stderr.String())
	}
	if _, err := os.Stat(ran); err == nil {
		t.Error("the job ran after the launcher was told to end")
	}
	if c := calls(t, logFile); !strings.Contains(c[len(c)-1], "quit") {
		t.Errorf("the daemon started was not stopped: %q", c)
	}
}

// TestLaunchForwardsSignals: a SIGTERM to the launcher (a scheduler's preemption) reaches the
// job, which ends its own way; the MPS daemon the launcher started is stopped after it, on
// the directory the job was given.
func TestLaunchForwardsSignals(t *testing.T) {
	logFile := fakeMPS(t)
	dir := t.TempDir()
	ready, got := filepath.Join(dir, "ready"), filepath.Join(dir, "got")
	job := `trap 'echo "$CUDA_MPS_PIPE_DIRECTORY" > ` + got + `; exit 7' TERM; touch ` + ready + `; while :; do sleep 0.02; done`
	type result struct {
		code int
		err  error
	}
	var stderr bytes.Buffer
	res := make(chan result, 1)
	go func() {
		code, err := launch([]string{"--mps", "--mps-dir", dir, "--run", "--", "sh", "-c", job}, &stderr)
		res <- result{code, err}
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the job did not start")
		}
	}
	sent := time.Now()
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-res:
		if r.code != 7 || r.err != nil {
			t.Fatalf("status %d, %v; want the job's 7 (%s)", r.code, r.err, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the launcher did not end 10 s after SIGTERM")
	}
	if d := time.Since(sent); d > 2*time.Second {
		t.Errorf("the job took %v to end after SIGTERM", d)
	}
	if b, err := os.ReadFile(got); err != nil || strings.TrimSpace(string(b)) != dir+"/pipe" {
		t.Errorf("the job's trap: %q, %v; want the pipe %s/pipe", b, err, dir)
	}
	c := calls(t, logFile)
	if !slices.ContainsFunc(c, func(s string) bool { return strings.HasPrefix(s, "-d ") }) || !strings.Contains(c[len(c)-1], "quit") {
		t.Errorf("the daemon was not started then stopped: %q", c)
	}
	for _, s := range c {
		if !strings.HasSuffix(s, "|"+dir+"/pipe") {
			t.Errorf("a call on another pipe than %s/pipe: %q", dir, s)
		}
	}
	if !strings.Contains(stderr.String(), "MPS started") {
		t.Errorf("stderr: %s", stderr.String())
	}
}

// TestLaunchKeepsOthersDaemon: a daemon that already answers (NVIDIA's default pipe here) is
// the job's, with nothing started, nothing stopped and the environment left as it is.
func TestLaunchKeepsOthersDaemon(t *testing.T) {
	t.Setenv("CUDA_MPS_PIPE_DIRECTORY", "")
	os.Unsetenv("CUDA_MPS_PIPE_DIRECTORY")
	logFile := fakeMPS(t, "")
	out := filepath.Join(t.TempDir(), "env")
	code, err := launch([]string{"--mps", "--run", "--", "sh", "-c", `echo "pipe=${CUDA_MPS_PIPE_DIRECTORY-unset}" > ` + out}, &bytes.Buffer{})
	if code != 0 || err != nil {
		t.Fatalf("status %d, %v", code, err)
	}
	if b, _ := os.ReadFile(out); strings.TrimSpace(string(b)) != "pipe=unset" {
		t.Errorf("the job's environment: %q", b)
	}
	for _, s := range calls(t, logFile) {
		if !strings.HasPrefix(strings.TrimSpace(s), "get_server_list") {
			t.Errorf("a call other than a query: %q", s)
		}
	}
}
