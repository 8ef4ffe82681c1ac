package device

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gocomm/gocomm/config"
	"github.com/gocomm/gocomm/internal/nvshmem"
	"github.com/gocomm/gocomm/wire"
)

// TestShmemID runs without a GPU: rank 0's sidecar makes the group's NVSHMEM unique id (it
// is the bootstrap's root), the client carries it through the torch Store, and every other
// rank's sidecar keeps what it is handed, for initShmem. Wrong hand-overs are refused, and a
// group with no id refuses to make its PE instead of waiting for a bootstrap that never comes.
func TestShmemID(t *testing.T) {
	sps, _ := filepath.Glob("../../.venv/lib/python3*/site-packages")
	path := nvshmem.Find(sps...)
	if path == nvshmem.LibraryName {
		t.Skip("no nvidia-nvshmem wheel in ../../.venv (run make): rank 0's half loads it")
	}
	for _, k := range []string{"NVSHMEM_DISABLE_NCCL", "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_DISABLE_NVLS",
		"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "NVSHMEM_SYMMETRIC_SIZE"} {
		t.Setenv(k, "") // loadShmem sets its defaults; restored after the test
	}
	member := func(rank int) *group {
		return &group{s: &session{a2a: config.Defaults().A2A, shmem: shmemState{path: path}}, rank: rank, size: 4}
	}

	g1 := member(1)
	if _, err := g1.initShmem(path, time.Now().Add(time.Minute)); !errors.Is(err, wire.ErrInvalid) || !strings.Contains(err.Error(), "ShmemID") {
		t.Fatalf("initShmem with no id: %v, want an ErrInvalid naming ShmemID", err)
	}

	root := member(0)
	if _, err := root.ShmemID([]byte{1, 2, 3}); !errors.Is(err, wire.ErrInvalid) {
		t.Fatalf("rank 0 handed an id: %v, want ErrInvalid", err)
	}
	id, err := root.ShmemID(nil)
	if err != nil {
		t.Fatalf("rank 0 ShmemID: %v", err)
	}
	if len(id) != len(nvshmem.UniqueID{}) || binary.LittleEndian.Uint32(id[:4]) != 1<<16+128 {
		t.Fatalf("rank 0's id: %d bytes, version %#x", len(id), binary.LittleEndian.Uint32(id[:4]))
	}
	if root.shmemID == nil || !bytes.Equal(root.shmemID[:], id) {
		t.Fatal("rank 0 did not keep the id it made")
	}
	if got := os.Getenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"); got != "lo" {
		t.Fatalf("the id was made with NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=%q, want lo", got)
	}

	if _, err := g1.ShmemID(id[:7]); !errors.Is(err, wire.ErrInvalid) {
		t.Fatalf("a short id: %v, want ErrInvalid", err)
	}
	if g1.shmemID != nil {
		t.Fatal("a refused id was kept")
	}
	back, err := g1.ShmemID(id)
	if err != nil || !bytes.Equal(back, id) || !bytes.Equal(g1.shmemID[:], id) {
		t.Fatalf("rank 1 ShmemID: %v (kept %v)", err, g1.shmemID != nil)
	}
}
