package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gocomm/gocomm/config"
)

// TestSpinAndLogLevel: a --spin or --log-level flag wins over GOCOMM_SPIN and
// GOCOMM_LOG_LEVEL, even --spin=0; without either, GOCOMM_SPIN unset spins 2 ms where CUDA
// is available and not at all where it is not.
func TestSpinAndLogLevel(t *testing.T) {
	for _, tc := range []struct {
		desc string
		args []string
		knob time.Duration
		cuda bool
		want time.Duration
	}{
		{"unset, CUDA", nil, config.SpinAuto, true, 2 * time.Millisecond},
		{"unset, no CUDA", nil, config.SpinAuto, false, 0},
		{"knob", nil, 500 * time.Microsecond, false, 500 * time.Microsecond},
		{"knob 0 on a CUDA host", nil, 0, true, 0},
		{"flag wins", []string{"--spin", "1ms"}, 500 * time.Microsecond, true, time.Millisecond},
		{"flag 0 wins", []string{"--spin=0"}, config.SpinAuto, true, 0},
	} {
		o, err := parseFlags(tc.args)
		if err != nil {
			t.Fatal(err)
		}
		if got := spinFor(o, tc.knob, tc.cuda); got != tc.want {
			t.Errorf("%s: spin %v, want %v", tc.desc, got, tc.want)
		}
	}
	o, _ := parseFlags(nil)
	if o.logLevel != "" {
		t.Errorf("--log-level defaults to %q: it would win over GOCOMM_LOG_LEVEL", o.logLevel)
	}
}

// TestUnknownCommand: a word pgserver does not know is refused, not taken for a server's
// flags (an older `gocomm` asking a newer pgserver, or the reverse, must not start a server).
func TestUnknownCommand(t *testing.T) {
	if _, err := parseFlags([]string{"frob"}); err == nil || !strings.Contains(err.Error(), `unknown command "frob"`) {
		t.Errorf("frob: %v", err)
	}
	if _, err := parseFlags([]string{"--spin", "1ms"}); err != nil {
		t.Errorf("flags only: %v", err)
	}
}

// TestSpinFlagBounded: --spin takes what GOCOMM_SPIN takes, 0 up to config.MaxSpin.
func TestSpinFlagBounded(t *testing.T) {
	for _, v := range []string{"-1ms", "2s"} {
		if _, err := parseFlags([]string{"--spin", v}); err == nil || !strings.Contains(err.Error(), "--spin") {
			t.Errorf("--spin %s: %v, want refused", v, err)
		}
	}
	if _, err := parseFlags([]string{"--spin", "1s"}); err != nil {
		t.Errorf("--spin 1s: %v", err)
	}
}

// TestGoTrace: GOCOMM_GO_TRACE's files are written and closed by stop; a prefix in a missing
// directory is an error naming the knob.
func TestGoTrace(t *testing.T) {
	prefix := filepath.Join(t.TempDir(), "pg-")
	stop, err := goTrace(prefix)
	if err != nil {
		t.Fatal(err)
	}
	stop()
	for _, ext := range []string{".trace", ".cpu"} {
		st, err := os.Stat(fmt.Sprintf("%s%d%s", prefix, os.Getpid(), ext))
		if err != nil || st.Size() == 0 {
			t.Errorf("%s: %v, %v", ext, st, err)
		}
	}
	if _, err := goTrace(filepath.Join(t.TempDir(), "nope", "pg-")); err == nil || !strings.Contains(err.Error(), "GOCOMM_GO_TRACE") {
		t.Errorf("missing directory: %v", err)
	}
}
