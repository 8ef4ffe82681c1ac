// Package spin counts the sidecar's goroutines that poll in a loop instead of sleeping (the
// session rings' consumers, the device workers, the graph-trigger watcher), so that
// together they never hold every P: a loop that yields its P through runtime.Gosched puts
// a thread wake-up (two, for a goroutine locked to its thread) on the path of whatever it
// polls for, so only spinners beyond half of GOMAXPROCS yield, and the Ps left run the
// scheduler: other goroutines, and timers (the device poller sleeps on one while an op is
// in flight).
package spin

import (
	"runtime"
	"sync/atomic"
	"time"
)

var spinning atomic.Int32

// Enter counts a spinner in; yield says whether its loop must call runtime.Gosched now and
// then. Each Enter is paired with one Exit.
func Enter() (yield bool) {
	return int(spinning.Add(1)) > runtime.GOMAXPROCS(0)/2
}

// Exit counts a spinner out.
func Exit() { spinning.Add(-1) }

// Spinning is how many spinners are counted in now.
func Spinning() int { return int(spinning.Load()) }

// For polls ready for up to d, counted in as a spinner; true once ready says so. Between
// checks it holds its P, yielding it every 64 checks only where Enter says to.
func For(d time.Duration, ready func() bool) bool {
	yield := Enter()
	defer Exit()
	end := time.Now().Add(d)
	for i := 0; ; i++ {
		if ready() {
			return true
		}
		if i&63 == 63 {
			if time.Now().After(end) {
				return false
			}
			if yield {
				runtime.Gosched()
			}
		}
	}
}
