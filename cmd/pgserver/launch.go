package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// mpsControl is the MPS control program; a variable so that tests can name a stand-in.
var mpsControl = "nvidia-cuda-mps-control"

// nvidiaPipe is where the MPS daemon and its clients meet when CUDA_MPS_PIPE_DIRECTORY is unset.
const nvidiaPipe = "/tmp/nvidia-mps"

// launchSignals are passed on to the job: what a scheduler (SIGTERM at preemption, SIGUSR1/2
// as a warning), a hang-up or a user sends the launcher.
var launchSignals = []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2}

// mpsPlace is where a job's ranks meet an MPS daemon: pipe and log directories, and which of
// them the job's environment must be given (none where the ranks find it by CUDA's default).
type mpsPlace struct {
	pipe, log string
	env       []string
}

// mpsWhere picks the daemon's place: --mps-dir D (D/pipe, D/log) first; else the
// environment's CUDA_MPS_PIPE_DIRECTORY; else NVIDIA's default pipe where a daemon answers
// there; else a directory of this user's. A daemon this launcher starts logs beside its pipe
// unless CUDA_MPS_LOG_DIRECTORY says where (NVIDIA's default log directory needs root).
func mpsWhere(dir string, getenv func(string) string, answers func(env []string) bool) mpsPlace {
	if dir != "" {
		p := mpsPlace{pipe: filepath.Join(dir, "pipe"), log: filepath.Join(dir, "log")}
		p.env = []string{"CUDA_MPS_PIPE_DIRECTORY=" + p.pipe, "CUDA_MPS_LOG_DIRECTORY=" + p.log}
		return p
	}
	own := filepath.Join(os.TempDir(), fmt.Sprintf("gocomm-mps-%d", os.Getuid()))
	p := mpsPlace{pipe: getenv("CUDA_MPS_PIPE_DIRECTORY"), log: getenv("CUDA_MPS_LOG_DIRECTORY")}
	if p.pipe == "" && answers(nil) {
		return mpsPlace{pipe: nvidiaPipe, log: p.log}
	}
	if p.pipe == "" {
		p.pipe = filepath.Join(own, "pipe")
		p.env = append(p.env, "CUDA_MPS_PIPE_DIRECTORY="+p.pipe)
	}
	if p.log == "" {
		p.log = filepath.Join(own, "log")
		p.env = append(p.env, "CUDA_MPS_LOG_DIRECTORY="+p.log)
	}
	return p
}

// mpsAsk sends one command to the MPS control daemon with env added to ours; the control
// program fails where no daemon answers.
func mpsAsk(env []string, args []string, stdin string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, mpsControl, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = bytes.NewBufferString(stdin)
	cmd.WaitDelay = 5 * time.Second // a daemon that kept our pipes must not hold this call
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		if msg := bytes.TrimSpace(out.Bytes()); len(msg) > 0 {
			return fmt.Errorf("%w: %s", err, msg)
		}
		return err
	}
	return nil
}

func mpsAnswers(env []string) bool { return mpsAsk(env, nil, "get_server_list\n") == nil }

// launch runs a job as `gocomm launch` does: with --mps it starts the MPS control daemon
// first where none answers (before any rank makes a CUDA context, which is when MPS has to be
// up) and stops the one it started when the job ends; the job is torchrun with the arguments
// after "--" (or, with --run, those arguments as a command). Signals the launcher gets go on
// to the job (passOn). It returns the job's exit status, or -n where signal n ended the job
// (the caller ends the same way, so a shell sees what it would have seen without it).
func launch(args []string, stderr io.Writer) (int, error) {
	fs := flag.NewFlagSet("pgserver launch", flag.ContinueOnError)
	fs.SetOutput(stderr)
	startMPS := fs.Bool("mps", false, "start the MPS control daemon where none answers, and stop it after the job")
	dir := fs.String("mps-dir", "", "the daemon's pipe and log directories are DIR/pipe and DIR/log (default: $CUDA_MPS_PIPE_DIRECTORY, else NVIDIA's default pipe where a daemon answers there, else /tmp/gocomm-mps-<uid>)")
	python := fs.String("python", "python3", "the Python that runs torchrun (torch.distributed.run)")
	run := fs.Bool("run", false, "run the arguments after -- as the command, not as torchrun's")
	if err := fs.Parse(args); err != nil {
		return 2, err
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return 2, errors.New("launch: give the job's arguments after -- (torchrun's, or with --run a command)")
	}
	say := func(format string, a ...any) { fmt.Fprintf(stderr, "gocomm launch: "+format+"\n", a...) }
	// From here until the daemon it started is stopped, a signal is the job's to take, not
	// the launcher's end. One ignored when the launcher started (nohup) stays ignored.
	sigs := make(chan os.Signal, 8)
	for _, s := range launchSignals {
		if !signal.Ignored(s) {
			signal.Notify(sigs, s)
		}
	}
	defer signal.Stop(sigs) // after the daemon's stop, deferred below
	place := mpsWhere(*dir, os.Getenv, mpsAnswers)
	started := false
	switch {
	case mpsAnswers(place.env):
	case !*startMPS:
		say("no MPS daemon on %s; ranks and sidecars will time-slice the GPUs (pass --mps)", place.pipe)
	default:
		var err error
		if started, err = mpsStart(place); err != nil {
			say("MPS not started (%v); running without it", err)
		} else {
			say("MPS started (pipe %s)", place.pipe)
		}
	}
	if started {
		defer func() {
			if err := mpsAsk(place.env, nil, "quit\n"); err != nil {
				say("could not stop the MPS daemon it started on %s: %v", place.pipe, err)
			}
		}()
	}
	select {
	case s := <-sigs: // while the daemon started: no job to pass it to
		if s := s.(syscall.Signal); ends(s) {
			say("%v before the job started: not starting it", s)
			return -int(s), nil
		}
	default:
	}
	cmd := exec.Command(*python, append([]string{"-m", "torch.distributed.run"}, rest...)...)
	if *run {
		cmd = exec.Command(rest[0], rest[1:]...)
	}
	cmd.Env = append(os.Environ(), place.env...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, stderr
	// A launcher killed outright (SIGKILL) still ends the job: the child gets SIGTERM when the
	// thread that started it ends, so that thread stays this goroutine's until the job ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cmd.Start(); err != nil {
		return 127, fmt.Errorf("launch: %w", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	handles := os.Getenv("TORCHELASTIC_SIGNALS_TO_HANDLE")
	ending := 0
	for {
		select {
		case s := <-sigs:
			sig := s.(syscall.Signal)
			switch to := passOn(sig, *run, handles, ending, terminalIsOurs()); to {
			case 0:
				if sig == syscall.SIGUSR1 || sig == syscall.SIGUSR2 {
					say("%v not passed on: torchrun would end on it and leave its workers running (name it in TORCHELASTIC_SIGNALS_TO_HANDLE to have torchrun take it)", sig)
				}
			case syscall.SIGKILL:
				say("%v again: killing the job", sig)
				_ = cmd.Process.Signal(to)
			default:
				_ = cmd.Process.Signal(to)
			}
			if ends(sig) {
				ending++
			}
		case err := <-done:
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					return -int(ws.Signal()), nil
				}
				return exit.ExitCode(), nil
			}
			if err != nil {
				return 1, fmt.Errorf("launch: %w", err)
			}
			return 0, nil
		}
	}
}

// endAsJob is the launcher's exit status for launch's: a job a signal ended (status -n) ends
// the launcher with that signal where it only ends a process (SIGINT, SIGTERM, SIGHUP,
// SIGKILL: a shell loop stops on Ctrl-C as it would without the launcher), with 128+n
// otherwise (no core of the launcher for the job's SIGSEGV or SIGQUIT).
func endAsJob(status int) int {
	if status >= 0 {
		return status
	}
	sig := syscall.Signal(-status)
	if sig == syscall.SIGINT || sig == syscall.SIGTERM || sig == syscall.SIGHUP || sig == syscall.SIGKILL {
		signal.Reset(sig)
		_ = syscall.Kill(os.Getpid(), sig)
		time.Sleep(time.Second) // delivered at once; the exit below only if it was not
	}
	return 128 + int(sig)
}

// ends: a signal that asks the job to end.
func ends(s syscall.Signal) bool {
	return s == syscall.SIGINT || s == syscall.SIGTERM || s == syscall.SIGHUP || s == syscall.SIGQUIT
}

// passOn is what the launcher sends the job for signal s (0: nothing). The job shares the
// launcher's process group: where that group has the terminal (ours), Ctrl-C and Ctrl-\
// reached the job already and are not sent twice (a kill -INT of the launcher alone, from
// elsewhere, is then not passed on either: no signal says who sent it). torchrun ends its
// workers on SIGINT, SIGTERM, SIGHUP and SIGQUIT, and on SIGUSR1/2 only where
// TORCHELASTIC_SIGNALS_TO_HANDLE (handles) names them: otherwise they would kill torchrun
// alone and leave its workers, which run in sessions of their own, running. A command
// (--run) gets every signal, and SIGKILL for a second one that asks it to end (ending: how
// many came before); torchrun is not killed so, which would orphan its workers.
func passOn(s syscall.Signal, run bool, handles string, ending int, ours bool) syscall.Signal {
	if ours && (s == syscall.SIGINT || s == syscall.SIGQUIT) {
		return 0
	}
	if run {
		if ends(s) && ending > 0 {
			return syscall.SIGKILL
		}
		return s
	}
	if (s == syscall.SIGUSR1 || s == syscall.SIGUSR2) && !slices.Contains(strings.Split(handles, ","), unix.SignalName(s)) {
		return 0
	}
	return s
}

// terminalIsOurs: this process's controlling terminal has this process group in the
// foreground (whatever stdin is).
func terminalIsOurs() bool {
	f, err := os.OpenFile("/dev/tty", os.O_RDONLY|syscall.O_NOCTTY, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	fg, err := unix.IoctlGetInt(int(f.Fd()), unix.TIOCGPGRP)
	return err == nil && fg == unix.Getpgrp()
}

// mpsStart starts the control daemon on place's directories and checks that it answers.
func mpsStart(place mpsPlace) (bool, error) {
	if _, err := exec.LookPath(mpsControl); err != nil {
		return false, fmt.Errorf("%s is not on PATH", mpsControl)
	}
	for _, d := range []string{place.pipe, place.log} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return false, err
		}
	}
	if err := mpsAsk(place.env, []string{"-d"}, ""); err != nil {
		return false, err
	}
	if !mpsAnswers(place.env) {
		return false, fmt.Errorf("the daemon started on %s does not answer", place.pipe)
	}
	return true, nil
}
