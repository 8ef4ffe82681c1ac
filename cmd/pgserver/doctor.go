// pgserver doctor: the checks of `gocomm doctor`, each ok/warn/fail with its fix, printed as
// a table (--json: rows). The sidecar is the process that maps its rank's memory and holds its
// peers' sockets, so it checks what it will need: shared memory, the fd limit, ptrace scope,
// the driver, CUDA IPC into this process, GPU 0's arch against the in-process kernels', MPS.
// What only the training process knows (its torch, the torch gocomm was built for, its CUDA
// IPC handle, the package's version and kernels) `gocomm doctor` hands over as flags, and
// pgserver checks it too: one place decides and prints every row.

package main

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"

	"github.com/gocomm/gocomm/config"
	"github.com/gocomm/gocomm/internal/cuda"
)

// Check statuses, as `gocomm doctor` prints them.
const (
	statusOK   = "ok"
	statusWarn = "warn"
	statusFail = "fail"
)

// checkRow is one check: what was found and, for anything but ok, how to fix it.
type checkRow struct {
	Check  string `json:"check"`
	Status string `json:"status"`
	Found  string `json:"found"`
	Fix    string `json:"fix"`
}

// need is a CUDA version some part of the install requires (who=major.minor).
type need struct {
	who          string
	major, minor int
}

type needs []need

func (n *needs) String() string { return fmt.Sprint(*n) }

func (n *needs) Set(v string) error {
	who, ver, ok := strings.Cut(v, "=")
	major, minor, ok2 := strings.Cut(ver, ".")
	a, err1 := strconv.Atoi(major)
	b, err2 := strconv.Atoi(strings.Split(minor, ".")[0])
	if !ok || !ok2 || who == "" || err1 != nil || err2 != nil {
		return fmt.Errorf("want who=MAJOR.MINOR, got %q", v)
	}
	*n = append(*n, need{who, a, b})
	return nil
}

// errChecksFailed: a check failed (pgserver exits 1, the table said why).
var errChecksFailed = errors.New("a check failed")

// doctor is `pgserver doctor [--json] [--ipc HEX | --ipc-error WHY] [--needs-cuda who=X.Y ...]
// [--gocomm VERSION] [--torch-here V --torch-built V --torch-cuda yes|no --kernels sm_XY]`.
func doctor(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("pgserver doctor", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "print the rows as JSON")
	ipc := fs.String("ipc", "", "a CUDA IPC handle (hex) of device 0 to map, as the sidecar maps its rank's tensors")
	ipcErr := fs.String("ipc-error", "", "why the training process could not export a CUDA IPC handle")
	var want needs
	fs.Var(&want, "needs-cuda", "who=MAJOR.MINOR: a CUDA version the driver must support (repeatable)")
	gocomm := fs.String("gocomm", "", "the gocomm package's version: this pgserver's must be the same")
	torchHere := fs.String("torch-here", "", "the torch the training process runs")
	torchBuilt := fs.String("torch-built", "", "the torch gocomm was built for (bin/build.json)")
	torchCUDA := fs.String("torch-cuda", "", "yes or no: whether that torch sees a GPU")
	kernels := fs.String("kernels", "", "the in-process kernels' GPU arch (sm_XY), checked against GPU 0's")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var rows []checkRow
	if *torchHere != "" {
		rows = append(rows, checkTorch(*torchBuilt, *torchHere))
	}
	if *gocomm != "" {
		rows = append(rows, checkVersion(os.Args[0], version, *gocomm))
	}
	rows = append(rows, checkConfig(os.Getenv))
	rows = append(rows, checkShm("/dev/shm", syscall.Statfs), checkFds(), checkPtrace("/proc/sys/kernel/yama/ptrace_scope"))
	// a job started by `gocomm launch` finds its MPS daemon where the launcher looks (mpsWhere):
	// so does the driver we load
	place := mpsWhere("", os.Getenv, mpsAnswers)
	for _, kv := range place.env {
		k, v, _ := strings.Cut(kv, "=")
		os.Setenv(k, v)
	}
	pipe := place.pipe
	rows = append(rows, checkCUDA(want, *ipc)...)
	if *ipcErr != "" {
		rows = append(rows, ipcFailed("CUDA IPC of a tensor: this process could not export one: "+*ipcErr))
	}
	switch *torchCUDA {
	case "no":
		for _, r := range rows {
			if r.Check == "driver" {
				rows = append(rows, checkRow{"CUDA", statusWarn, "a driver, but torch sees no GPU", "check CUDA_VISIBLE_DEVICES and /dev/nvidia*"})
				break
			}
		}
	case "yes":
		rows = append(rows, checkGPU0(*kernels, pipe)...)
	}
	if err := printRows(out, rows, *asJSON); err != nil {
		return err
	}
	for _, r := range rows {
		if r.Status == statusFail {
			return errChecksFailed
		}
	}
	return nil
}

// printRows writes rows as `gocomm doctor` shows them: a table, each fix under its row.
func printRows(out io.Writer, rows []checkRow, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(rows)
	}
	for _, r := range rows {
		fmt.Fprintf(out, "[%-4s] %-12s %s\n", r.Status, r.Check, r.Found)
		if r.Fix != "" {
			fmt.Fprintf(out, "%19s fix: %s\n", "", r.Fix)
		}
	}
	return nil
}

// checkConfig reads every knob of the table (docs/config.md) as a sidecar started here and its
// training process would: a value the table does not accept fails the row (the sidecar would
// not start), a deprecated name warns.
func checkConfig(getenv func(string) string) checkRow {
	_, warnings, err := config.Load(getenv)
	switch {
	case err != nil:
		return checkRow{"config", statusFail, err.Error(), "fix or unset the variables named (docs/config.md says what each accepts)"}
	case len(warnings) > 0:
		return checkRow{"config", statusWarn, strings.Join(warnings, "; "), "rename the variables named"}
	}
	return checkRow{"config", statusOK, "every GOCOMM_ variable of the table is accepted", ""}
}

// checkTorch: the torch running against the one gocomm (the compiled client) was built for.
func checkTorch(built, here string) checkRow {
	base := func(v string) string { return strings.SplitN(v, "+", 2)[0] }
	switch {
	case built == "":
		return checkRow{"torch", statusWarn, fmt.Sprintf("torch %s; no build record (bin/build.json)", here), "run `make` (checkout) or reinstall the wheel"}
	case base(built) != base(here):
		return checkRow{"torch", statusFail, fmt.Sprintf("gocomm was built for torch %s, this is torch %s", built, here), "pip install torch==" + base(built)}
	case strings.Contains(built, "+") && strings.Contains(here, "+") && built != here:
		return checkRow{"torch", statusWarn, fmt.Sprintf("built for %s, running %s (other CUDA build)", built, here), "install torch " + built}
	}
	return checkRow{"torch", statusOK, fmt.Sprintf("torch %s (built for %s)", here, built), ""}
}

// checkVersion: this pgserver (exe, of version ours) against the gocomm package's version.
func checkVersion(exe, ours, gocomm string) checkRow {
	if ours != gocomm {
		return checkRow{"pgserver", statusFail, fmt.Sprintf("%s is pgserver %s, gocomm is %s", exe, ours, gocomm), "install the matching wheel"}
	}
	return checkRow{"pgserver", statusOK, fmt.Sprintf("%s runs, version %s", exe, ours), ""}
}

// checkGPU0: GPU 0's arch against the in-process kernels' (kernels), and whether its contexts
// go through an MPS daemon (on pipe).
func checkGPU0(kernels, pipe string) []checkRow {
	if cuda.Load() != nil {
		return nil // checkCUDA said so
	}
	d, err := cuda.DeviceGet(0)
	if err != nil {
		return []checkRow{{"kernels", statusWarn, fmt.Sprintf("torch sees a GPU, this process none: %v", err), "check CUDA_VISIBLE_DEVICES and /dev/nvidia*"}}
	}
	major, _ := d.Attribute(cuda.AttrComputeCapabilityMajor)
	minor, _ := d.Attribute(cuda.AttrComputeCapabilityMinor)
	mps, err := d.Attribute(cuda.AttrMPSEnabled)
	return []checkRow{checkKernels(kernels, fmt.Sprintf("sm_%d%d", major, minor)), checkMPS(mps != 0, err, pipe)}
}

// checkKernels: the in-process kernels (cubins for one arch, built) on GPU 0 (here).
func checkKernels(built, here string) checkRow {
	if built != "" && built != here {
		return checkRow{"kernels", statusWarn,
			fmt.Sprintf("the in-process kernels are built for %s, GPU 0 is %s: their ops take sidecar NCCL", built, here),
			"build with make CUDA_ARCH=" + here}
	}
	return checkRow{"kernels", statusOK, fmt.Sprintf("kernels built for %s, GPU 0 is %s", built, here), ""}
}

// checkMPS: whether this process's contexts go through an MPS daemon on pipe, as a job's will.
func checkMPS(on bool, err error, pipe string) checkRow {
	const fix = "start jobs with `gocomm launch --mps -- <torchrun args>`"
	switch {
	case err != nil:
		return checkRow{"MPS", statusWarn, fmt.Sprintf("the driver does not say whether MPS is on: %v", err), fix}
	case !on:
		return checkRow{"MPS", statusWarn, "no MPS daemon: each op's hand-off to the sidecar costs a GPU context switch (~0.29 ms)", fix}
	}
	return checkRow{"MPS", statusOK, "an MPS daemon answers on " + pipe, ""}
}

func checkShm(path string, statfs func(string, *syscall.Statfs_t) error) checkRow {
	var st syscall.Statfs_t
	if err := statfs(path, &st); err != nil {
		return checkRow{"/dev/shm", statusWarn, fmt.Sprintf("%s: %v; shared memory falls back to the runtime directory", path, err), "mount a tmpfs on /dev/shm"}
	}
	size := float64(uint64(st.Bsize)*st.Blocks) / (1 << 30)
	free := uint64(st.Bsize) * st.Bavail
	found := fmt.Sprintf("%s %.1f GiB, %.1f GiB free", path, size, float64(free)/(1<<30))
	fix := "give the container more (docker run --shm-size=16g) or mount -o remount,size=16g /dev/shm"
	switch {
	case free < 256<<20:
		return checkRow{"/dev/shm", statusFail, found + " (CPU tensors are staged there: each rank's arena starts at 16 MiB and doubles)", fix}
	case free < 2<<30:
		return checkRow{"/dev/shm", statusWarn, found + " (large CPU collectives need more)", fix}
	}
	return checkRow{"/dev/shm", statusOK, found, ""}
}

func checkFds() checkRow {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return checkRow{"fd limit", statusWarn, fmt.Sprintf("getrlimit: %v", err), "ulimit -n 65536 before the job"}
	}
	found := fmt.Sprintf("open files: soft %d, hard %d", l.Cur, l.Max)
	if l.Cur < 4096 {
		raise := uint64(65536)
		if l.Max >= 4096 && l.Max != ^uint64(0) {
			raise = l.Max
		}
		return checkRow{"fd limit", statusWarn, found + " (each rank holds sockets to every peer and shared-memory segments)", fmt.Sprintf("ulimit -n %d before the job", raise)}
	}
	return checkRow{"fd limit", statusOK, found, ""}
}

func checkPtrace(path string) checkRow {
	b, err := os.ReadFile(path)
	if err != nil {
		return checkRow{"ptrace scope", statusOK, "no Yama LSM: pidfd_getfd between a rank and its sidecar is allowed", ""}
	}
	scope := strings.TrimSpace(string(b))
	if scope == "0" {
		return checkRow{"ptrace scope", statusOK, path + " = 0: pidfd_getfd between a rank and its sidecar is allowed", ""}
	}
	return checkRow{"ptrace scope", statusWarn,
		fmt.Sprintf("%s = %s: a sidecar cannot take file descriptors from its rank (pidfd_getfd, the by-reference path)", path, scope),
		"sysctl -w kernel.yama.ptrace_scope=0, or run with CAP_SYS_PTRACE"}
}

// checkCUDA: the driver against what the install needs, and mapping a CUDA IPC handle.
func checkCUDA(want needs, ipc string) []checkRow {
	if err := cuda.Load(); err != nil {
		return []checkRow{{"CUDA", statusOK, "no CUDA driver: CPU tensors only (the host engine)", ""}}
	}
	drv, err := cuda.DriverVersion()
	if err != nil {
		return []checkRow{{"driver", statusFail, err.Error(), "reinstall the NVIDIA driver"}}
	}
	drvS := fmt.Sprintf("%d.%d", drv/1000, drv%1000/10)
	rows := []checkRow{}
	if len(want) == 0 {
		rows = append(rows, checkRow{"driver", statusOK, "driver supports CUDA " + drvS, ""})
	}
	for _, n := range want {
		if n.major*1000+n.minor*10 > drv {
			rows = append(rows, checkRow{"driver", statusFail,
				fmt.Sprintf("driver supports CUDA %s, %s needs %d.%d", drvS, n.who, n.major, n.minor),
				"upgrade the NVIDIA driver (or install a gocomm/torch built for this CUDA)"})
		} else {
			rows = append(rows, checkRow{"driver", statusOK, fmt.Sprintf("driver supports CUDA %s >= %s's %d.%d", drvS, n.who, n.major, n.minor), ""})
		}
	}
	if ipc != "" {
		rows = append(rows, checkIPC(ipc))
	}
	return rows
}

// ipcFailed is the CUDA IPC row of a handle that could not be made or mapped.
func ipcFailed(found string) checkRow {
	return checkRow{"CUDA IPC", statusFail, found,
		"in a container, share the host's IPC namespace (docker --ipc=host); MIG instances and some vGPUs have no CUDA IPC"}
}

func checkIPC(hexHandle string) checkRow {
	fail := func(err error) checkRow {
		return ipcFailed(fmt.Sprintf("CUDA IPC of a tensor: another process could not map it: %v", err))
	}
	b, err := hex.DecodeString(hexHandle)
	var h cuda.IPCHandle
	if err != nil || len(b) != len(h) {
		return fail(fmt.Errorf("--ipc wants %d bytes of hex", len(h)))
	}
	copy(h[:], b)
	dev, err := cuda.DeviceGet(0)
	if err != nil {
		return fail(err)
	}
	ctx, err := dev.PrimaryContext()
	if err != nil {
		return fail(err)
	}
	defer dev.ReleasePrimaryContext()
	if err := ctx.SetCurrent(); err != nil {
		return fail(err)
	}
	p, err := cuda.OpenIPC(h)
	if err != nil {
		return fail(err)
	}
	cuda.CloseIPC(p)
	return checkRow{"CUDA IPC", statusOK, "another process (the sidecar) maps a tensor's memory by its CUDA IPC handle", ""}
}
