package reduce

import (
	"fmt"
	"math"
	"testing"

	"github.com/gocomm/gocomm/internal/hostreduce"
	"github.com/gocomm/gocomm/wire"
)

// BenchmarkSum measures Into(dtype, wire.Sum) on buffers of 16 MiB (larger than
// the L2 cache, so bound by memory/L3 bandwidth), 64 KiB (cache resident)
// and 256 B (dominated by the fixed cost of a call, mostly the cgo
// transition). The reported throughput is bytes of dst per second.
func BenchmarkSum(b *testing.B) {
	b.Logf("kernels: %s", hostreduce.CPULevel())
	for _, d := range []wire.DType{wire.Float32, wire.BFloat16, wire.Float16, wire.Int64} {
		for _, size := range []int{16 << 20, 64 << 10, 256} {
			b.Run(fmt.Sprintf("%s/%s", d, sizeName(size)), func(b *testing.B) {
				dst, src := benchInputs(d, size)
				b.SetBytes(int64(len(dst)))
				b.ResetTimer()
				for b.Loop() {
					if err := Into(d, wire.Sum, dst, src); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// benchInputs fills both buffers with ordinary finite values (no NaN or
// subnormals, which can be slow on some CPUs) of type d.
func benchInputs(d wire.DType, size int) (dst, src []byte) {
	dst, src = make([]byte, size), make([]byte, size)
	n := size / d.Size()
	for i := range n {
		v := 1 + float64(i%1000)/1000
		switch d {
		case wire.Float32:
			ne.PutUint32(dst[4*i:], math.Float32bits(float32(v)))
			ne.PutUint32(src[4*i:], math.Float32bits(float32(-v/3)))
		case wire.BFloat16, wire.Float16:
			ne.PutUint16(dst[2*i:], halfOf(d).round(float64(float32(v))))
			ne.PutUint16(src[2*i:], halfOf(d).round(float64(float32(-v/3))))
		case wire.Int64:
			ne.PutUint64(dst[8*i:], uint64(i))
			ne.PutUint64(src[8*i:], uint64(3*i))
		}
	}
	return dst, src
}
