package nvshmem

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gocomm/gocomm/config"
	"github.com/gocomm/gocomm/gpu"
	lib "github.com/gocomm/gocomm/internal/nvshmem"
	"github.com/gocomm/gocomm/wire"
)

// TestShmemID runs without a GPU: rank 0's sidecar makes the group's NVSHMEM unique id (it
// is the bootstrap's root), the client carries it through the torch Store, and every other
// rank's sidecar keeps what it is handed, for initShmem. Wrong hand-overs are refused, and a
// group with no id refuses to make its PE instead of waiting for a bootstrap that never comes.
func TestShmemID(t *testing.T) {
	sps, _ := filepath.Glob("../../.venv/lib/python3*/site-packages")
	path := lib.Find(sps...)
	if path == lib.LibraryName {
		t.Skip("no nvidia-nvshmem wheel in ../../.venv (run make): rank 0's half loads it")
	}
	for _, k := range []string{"NVSHMEM_DISABLE_NCCL", "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_DISABLE_NVLS",
		"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "NVSHMEM_SYMMETRIC_SIZE"} {
		t.Setenv(k, "") // loadShmem sets its defaults; restored after the test
	}
	e := New(fakeSession{}, slog.Default(), config.Defaults().A2A, path)
	member := func(rank int) *Member { return e.Member(fakeGroup{rank: rank, size: 4}) }

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
	if len(id) != len(lib.UniqueID{}) || binary.LittleEndian.Uint32(id[:4]) != 1<<16+128 {
		t.Fatalf("rank 0's id: %d bytes, version %#x", len(id), binary.LittleEndian.Uint32(id[:4]))
	}
	if root.id == nil || !bytes.Equal(root.id[:], id) {
		t.Fatal("rank 0 did not keep the id it made")
	}
	if got := os.Getenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"); got != "lo" {
		t.Fatalf("the id was made with NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=%q, want lo", got)
	}

	if _, err := g1.ShmemID(id[:7]); !errors.Is(err, wire.ErrInvalid) {
		t.Fatalf("a short id: %v, want ErrInvalid", err)
	}
	if g1.id != nil {
		t.Fatal("a refused id was kept")
	}
	back, err := g1.ShmemID(id)
	if err != nil || !bytes.Equal(back, id) || !bytes.Equal(g1.id[:], id) {
		t.Fatalf("rank 1 ShmemID: %v (kept %v)", err, g1.id != nil)
	}
}

// fakeSession runs f on the caller's thread (no device).
type fakeSession struct{}

func (fakeSession) Do(f func() error) error { return f() }

// fakeGroup is rank of size, with link as its host link.
type fakeGroup struct {
	rank, size int
	link       gpu.PeerLink
}

func (g fakeGroup) Rank() int          { return g.rank }
func (g fakeGroup) Size() int          { return g.size }
func (g fakeGroup) Link() gpu.PeerLink { return g.link }

// fakeLink records what is sent and answers every Recv with reply[peer].
type fakeLink struct {
	sent  map[int][]byte
	reply map[int]byte
}

func (l *fakeLink) Send(_ context.Context, peer, tag int, b []byte) error {
	if tag != tagShmemOK {
		return errors.New("wrong tag")
	}
	l.sent[peer] = append([]byte(nil), b...)
	return nil
}

func (l *fakeLink) Recv(_ context.Context, peer, tag, n int) ([]byte, error) {
	if tag != tagShmemOK || n != 1 {
		return nil, errors.New("wrong tag or size")
	}
	return []byte{l.reply[peer]}, nil
}

// TestAgree: every rank tells every other whether it is ready, and goes on only if all are.
func TestAgree(t *testing.T) {
	ctx := context.Background()
	run := func(local error, reply map[int]byte) (*fakeLink, error) {
		l := &fakeLink{sent: map[int][]byte{}, reply: reply}
		return l, agree(ctx, fakeGroup{rank: 1, size: 3, link: l}, local)
	}
	l, err := run(nil, map[int]byte{0: 1, 2: 1})
	if err != nil || len(l.sent) != 2 || l.sent[0][0] != 1 || l.sent[2][0] != 1 || l.sent[1] != nil {
		t.Fatalf("all ready: %v, sent %v", err, l.sent)
	}
	if _, err := run(nil, map[int]byte{0: 1, 2: 0}); err == nil || !strings.Contains(err.Error(), "rank 2") {
		t.Fatalf("rank 2 not ready: %v, want an error naming rank 2", err)
	}
	mine := errors.New("no heap")
	l, err = run(mine, nil)
	if !errors.Is(err, mine) || l.sent[0][0] != 0 || l.sent[2][0] != 0 {
		t.Fatalf("this rank not ready: %v, sent %v", err, l.sent)
	}
}

// TestA2AVShape: blocks per destination from the total, at least one each.
func TestA2AVShape(t *testing.T) {
	c := config.Defaults().A2A
	c.Blocks, c.Threads, c.Direct = 128, 512, true
	if got := a2avShapeOf(8, c); got != (a2avShape{blocksPer: 16, threads: 512, direct: 1}) {
		t.Fatalf("8 ranks: %+v", got)
	}
	c.Blocks, c.Direct = 4, false
	if got := a2avShapeOf(8, c); got != (a2avShape{blocksPer: 1, threads: 512, direct: 0}) {
		t.Fatalf("fewer blocks than ranks: %+v", got)
	}
}
