package dl

import (
	"errors"
	"strings"
	"testing"
)

func TestLoadOnce(t *testing.T) {
	errNo := errors.New("x: not loaded")
	l := New("x", "libx.so.1", errNo)
	var opened []string
	open := func(p string) string {
		opened = append(opened, p)
		if strings.HasPrefix(p, "/bad") {
			return "no such file"
		}
		return ""
	}
	if err := l.Load("/bad/libx.so", open); !errors.Is(err, errNo) || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("failed load: %v", err)
	}
	if err := l.Loaded(); !errors.Is(err, errNo) {
		t.Fatalf("Loaded after a failed load: %v", err)
	}
	if err := l.Load("", open); err != nil {
		t.Fatalf("default path: %v", err)
	}
	if err := l.Loaded(); err != nil {
		t.Fatalf("Loaded after a load: %v", err)
	}
	if err := l.Load("libx.so.1", open); err != nil {
		t.Fatalf("same path again: %v", err)
	}
	if err := l.Load("/other/libx.so", open); err == nil || !strings.Contains(err.Error(), "already loaded") {
		t.Fatalf("second copy: %v", err)
	}
	if strings.Join(opened, ",") != "/bad/libx.so,libx.so.1" {
		t.Fatalf("opened %v, want the bad path then the default once", opened)
	}
}
