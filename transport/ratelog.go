package transport

import (
	"log/slog"
	"sync"
	"time"
)

// rateLog writes warnings about peers that are not part of any group (junk, floods, wrong
// secrets) at most once per interval; the lines left out are counted in one line at the end
// of the interval. Anyone who can reach the listener can cause these, so they must not fill
// the log.
type rateLog struct {
	log      *slog.Logger
	interval time.Duration

	mu      sync.Mutex
	last    time.Time
	missed  int
	lastMsg string
	timer   *time.Timer // pending summary of the lines left out
}

func newRateLog(log *slog.Logger, interval time.Duration) *rateLog {
	return &rateLog{log: log, interval: interval}
}

func (r *rateLog) warn(msg string, args ...any) {
	r.mu.Lock()
	now := time.Now()
	if since := now.Sub(r.last); since < r.interval {
		r.missed++
		r.lastMsg = msg
		if r.timer == nil {
			r.timer = time.AfterFunc(r.interval-since, r.summary)
		}
		r.mu.Unlock()
		return
	}
	r.last = now
	r.mu.Unlock()
	r.log.Warn(msg, args...)
}

// summary writes how many lines were left out since the last one written.
func (r *rateLog) summary() {
	r.mu.Lock()
	missed, msg := r.missed, r.lastMsg
	r.missed, r.timer, r.last = 0, nil, time.Now()
	r.mu.Unlock()
	if missed > 0 {
		r.log.Warn("more warnings about peer links left out", "similar_lines_left_out", missed, "last", msg)
	}
}
