package spin

import (
	"runtime"
	"testing"
)

// TestEnter: at GOMAXPROCS 2 one spinner holds its P and a second, of either kind, yields,
// so one P always runs the scheduler.
func TestEnter(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
	if Enter() {
		t.Fatal("the first of two Ps' spinners yields")
	}
	if !Enter() {
		t.Fatal("a second spinner at GOMAXPROCS 2 holds its P: no P would run the scheduler")
	}
	Exit()
	Exit()
	if n := Spinning(); n != 0 {
		t.Fatalf("%d spinners counted after every Exit", n)
	}
	if Enter() {
		t.Fatal("a spinner after the others left yields")
	}
	Exit()
}
