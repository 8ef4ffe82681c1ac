// Package dl keeps the bookkeeping of a library loaded at run time that the cgo bindings
// (internal/nccl, internal/nvshmem) share: which file was loaded, and that a process loads
// one copy. The dlopen itself stays in each binding's C preamble (its symbol table differs).
package dl

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// Library is one run-time loaded library of the process.
type Library struct {
	name        string // for messages: "nccl", "nvshmem"
	defaultPath string
	notLoaded   error

	mu     sync.Mutex
	path   string      // the file loaded, "" until one is
	loaded atomic.Bool // path is set: read on every call of the bindings, without mu
}

// New describes a library: its short name, the file the loader searches for when no path
// is given, and the error calls return before it is loaded.
func New(name, defaultPath string, notLoaded error) *Library {
	return &Library{name: name, defaultPath: defaultPath, notLoaded: notLoaded}
}

// Load opens the library from path ("" for the default) with open, which returns the
// loader's message on failure. The first successful load wins; a later call with another
// path says which copy is in use, a failed one may be retried.
func (l *Library) Load(path string, open func(path string) string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if path == "" {
		path = l.defaultPath
	}
	if l.path != "" {
		if path != l.path {
			return fmt.Errorf("%s: %s requested but %s is already loaded", l.name, path, l.path)
		}
		return nil
	}
	if msg := open(path); msg != "" {
		return fmt.Errorf("%w: %s", l.notLoaded, msg)
	}
	l.path = path
	l.loaded.Store(true)
	return nil
}

// Loaded is nil once a Load succeeded, else the library's not-loaded error. The bindings ask
// it before each call into the library: no lock, no cgo call.
func (l *Library) Loaded() error {
	if !l.loaded.Load() {
		return l.notLoaded
	}
	return nil
}
