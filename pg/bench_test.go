package pg

import (
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gocomm/gocomm/wire"
)

// BenchmarkAllReduce times all_reduce through n in-process sidecars (sessions, rings,
// segments, transport), the client side reduced to submitting and waiting.
func BenchmarkAllReduce(b *testing.B) {
	for _, n := range []int{2, 4} {
		for _, size := range []uint64{1 << 20, 16 << 20, 64 << 20} {
			b.Run(fmt.Sprintf("ranks=%d/bytes=%d", n, size), func(b *testing.B) {
				t := &testing.T{}
				clients, groups := cluster(t, n, time.Minute)
				segs := make([]uint32, n)
				for r := range clients {
					clients[r].t = t
					segs[r], _ = clients[r].segment(size)
				}
				b.SetBytes(int64(size))
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					var wg sync.WaitGroup
					for r := 0; r < n; r++ {
						clients[r].submit(wire.Desc{Group: groups[r].Handle, Kind: wire.OpAllReduce, DType: wire.Float32,
							RedOp: wire.Sum, Count: size / 4, Bufs: []wire.BufRef{{Segment: segs[r], Length: size}}})
						wg.Add(1)
						go func(r int) {
							defer wg.Done()
							if d := clients[r].next(time.Minute); d.status != wire.StatusOK {
								b.Error(d.msg)
							}
						}(r)
					}
					wg.Wait()
				}
			})
		}
	}
}

// BenchmarkSubmitCUDA times the sidecar's own steps for one CUDA op, from the descriptor's
// bytes to the device engine's Enqueue (decode, checks, buffer resolution, the flight record,
// the group's hand-off), on a stub engine that finishes each op inside Enqueue; a goroutine
// drains the completions. docs/perf.md compares it with the same steps on a GPU host.
func BenchmarkSubmitCUDA(b *testing.B) {
	t := &testing.T{}
	eng := &fakeEngine{instant: true}
	clients, groups := deviceCluster(t, 1, time.Minute, eng)
	c, sess := clients[0], clients[0].sess
	seg := uint32(wire.CUDASegment | 1)
	c.registerIPC(seg, 1<<30)
	for end := time.Now().Add(10 * time.Second); sess.deviceSession().Segments().Live == 0; { // serve registers it
		if time.Now().After(end) {
			b.Fatal("the segment was not registered within 10 s")
		}
		time.Sleep(time.Millisecond)
	}
	stop := make(chan struct{})
	drained := make(chan struct{})
	var failed int32 // a completion that was not OK: the benchmark timed the refusal path
	go func() {
		defer close(drained)
		for {
			if rec, ok, _ := c.cons.Next(); ok {
				if decodeDone(rec.Payload).status != wire.StatusOK {
					failed++
				}
				c.cons.Release()
				continue
			}
			select {
			case <-stop:
				return
			default:
				c.cons.Wait(0, time.Millisecond)
			}
		}
	}()
	d := wire.Desc{Group: groups[0].Handle, Kind: wire.OpAllGather, DType: wire.BFloat16, Device: wire.DeviceCUDA,
		Count: 4096, Bufs: []wire.BufRef{{Segment: seg, Length: 8192}, {Segment: seg, Offset: 8192, Length: 8192}}}
	p := d.Encode()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		binary.LittleEndian.PutUint64(p, uint64(i+1))      // seq
		binary.LittleEndian.PutUint32(p[48:], uint32(i+1)) // stream value
		sess.submit(p)
	}
	b.StopTimer()
	close(stop)
	<-drained
	if failed > 0 {
		b.Fatalf("%d of %d ops did not complete OK", failed, b.N)
	}
}
