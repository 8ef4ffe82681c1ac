package transport

import (
	"log/slog"
	"sync"
	"time"
)

// rateLog writes warnings about peers that are not part of any group (junk, floods, wrong
// secrets) at most once per interval; the next line written says how many were left out.
// Anyone who can reach the listener can cause these, so they must not fill the log.
type rateLog struct {
	log      *slog.Logger
	interval time.Duration

	mu     sync.Mutex
	last   time.Time
	missed int
}

func newRateLog(log *slog.Logger, interval time.Duration) *rateLog {
	return &rateLog{log: log, interval: interval}
}

func (r *rateLog) warn(msg string, args ...any) {
	r.mu.Lock()
	now := time.Now()
	if now.Sub(r.last) < r.interval {
		r.missed++
		r.mu.Unlock()
		return
	}
	r.last = now
	missed := r.missed
	r.missed = 0
	r.mu.Unlock()
	if missed > 0 {
		args = append(args, "similar_lines_left_out", missed)
	}
	r.log.Warn(msg, args...)
}
