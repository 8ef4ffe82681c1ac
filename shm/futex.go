package shm

import (
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Futex operations on words in shared mappings. These are the process-shared variants (no
// FUTEX_PRIVATE_FLAG): the kernel keys the wait queue on the page, so a waiter in one process
// is woken by a waker in another that maps the same file.
const (
	futexWait = 0
	futexWake = 1
)

// Wait blocks while *addr == val, for at most timeout (0: no limit). It returns early, with
// no error, when woken, when *addr != val on entry, on a signal, or at the timeout; callers
// re-check their condition in a loop.
func Wait(addr *uint32, val uint32, timeout time.Duration) {
	var tsp unsafe.Pointer
	if timeout > 0 {
		ts := unix.NsecToTimespec(int64(timeout))
		tsp = unsafe.Pointer(&ts)
	}
	unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWait, uintptr(val), uintptr(tsp), 0, 0)
}

// Wake wakes up to n waiters blocked on addr.
func Wake(addr *uint32, n int) {
	unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWake, uintptr(n), 0, 0, 0)
}
