package collectives

import (
	"io"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/wire"
)

// CopySink writes the payload into Dst.
type CopySink struct{ Dst []byte }

func (s CopySink) Len() int { return len(s.Dst) }

func (s CopySink) Fill(r io.Reader, _ []byte) error {
	_, err := io.ReadFull(r, s.Dst)
	return err
}

func (s CopySink) Take(b []byte) error {
	copy(s.Dst, b)
	return nil
}

// ReduceSink combines the payload into Acc: Acc = Acc (op) payload.
type ReduceSink struct {
	Acc   []byte
	DType wire.DType
	Op    wire.RedOp
}

func (s ReduceSink) Len() int { return len(s.Acc) }

// Fill reads the payload in pieces that fit scratch and reduces each as it lands, so the
// reduction overlaps the transfer of the next piece (the sender keeps streaming).
func (s ReduceSink) Fill(r io.Reader, scratch []byte) error {
	es := s.DType.Size()
	piece := len(scratch) / es * es
	for off := 0; off < len(s.Acc); {
		n := min(piece, len(s.Acc)-off)
		if _, err := io.ReadFull(r, scratch[:n]); err != nil {
			return err
		}
		if err := reduce.Into(s.DType, s.Op, s.Acc[off:off+n], scratch[:n]); err != nil {
			return err
		}
		off += n
	}
	return nil
}

func (s ReduceSink) Take(b []byte) error {
	return reduce.Into(s.DType, s.Op, s.Acc, b)
}
