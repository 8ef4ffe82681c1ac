// pgserver doctor: the node checks of `gocomm doctor` that need no torch (shared memory, the
// fd limit, ptrace scope, the driver, CUDA IPC into this process), printed as JSON rows.
// The sidecar is the process that maps its rank's memory and holds its peers' sockets, so it
// checks what it will need; the Python command adds the torch-side checks and prints them all.

package main

import (
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"

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

// doctor is `pgserver doctor [--ipc HEX] [--needs-cuda who=X.Y ...]`.
func doctor(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("pgserver doctor", flag.ContinueOnError)
	ipc := fs.String("ipc", "", "a CUDA IPC handle (hex) of device 0 to map, as the sidecar maps its rank's tensors")
	var want needs
	fs.Var(&want, "needs-cuda", "who=MAJOR.MINOR: a CUDA version the driver must support (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	rows := []checkRow{
		checkShm("/dev/shm", syscall.Statfs),
		checkFds(),
		checkPtrace("/proc/sys/kernel/yama/ptrace_scope"),
	}
	rows = append(rows, checkCUDA(want, *ipc)...)
	enc := json.NewEncoder(out)
	enc.SetIndent("", " ")
	return enc.Encode(rows)
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

func checkIPC(hexHandle string) checkRow {
	fail := func(err error) checkRow {
		return checkRow{"CUDA IPC", statusFail, fmt.Sprintf("CUDA IPC of a tensor: another process could not map it: %v", err),
			"in a container, share the host's IPC namespace (docker --ipc=host); MIG instances and some vGPUs " +
				"have no CUDA IPC"}
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
