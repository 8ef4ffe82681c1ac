package pg

import (
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
