package pg

import (
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/wire"
)

// Errors of pg's API, shared with the packages on the other side of its seams so that
// errors.Is holds across them.
var (
	ErrInvalid  = wire.ErrInvalid
	ErrNotFound = wire.ErrNotFound
	ErrNoDevice = gpu.ErrNoDevice
	ErrTimeout  = gpu.ErrTimeout
)

const (
	// slotAdvance is how far past the last group's floor the next group on a slot starts:
	// beyond anything a release of the last group wrote, and within 2^31 of the last group's
	// values, so its late stream waits still read as done.
	slotAdvance = gpu.ReleaseAhead + 1<<24
	// maxDestroyed is how many destroyed groups a session remembers, to fail the ops its
	// client queued on them before the destroy as aborted (not as invalid descriptors).
	maxDestroyed = 1024
)
