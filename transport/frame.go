// Package transport moves bytes between the sidecars of a process group: framed messages on
// authenticated links (TCP between hosts), matched at the receiver against posted receives.
//
// Every data frame carries the signature of the collective it belongs to (op, dtype, reduce
// op, root, count), so ranks that call different collectives, or the same one with different
// sizes, fail with an error that names both calls instead of hanging.
package transport

import (
	"encoding/binary"
	"fmt"
	"io"

	"github.com/gocomm/gocomm/wire"
)

// Frame kinds.
const (
	kindColl  uint8 = 1 // collective data: seq, step, slice, signature
	kindP2P   uint8 = 2 // point-to-point data: tag
	kindAbort uint8 = 3 // the sender broke the group; payload is the reason
	kindBye   uint8 = 4 // the sender is leaving the group on purpose
	kindAck   uint8 = 5 // the receiver is done with a payload sent by reference (seq: its id)
	// kindBeat: the sender is alive; seq and count carry its group's progress (the last
	// collective started and finished, each plus one, 0 for none). Sent on idle links.
	kindBeat uint8 = 6
)

// Frame flags.
const (
	// flagRef: a data frame (kindColl, kindP2P) whose payload stays in the sender's shared
	// segment; a refTrailer says where, instead of length bytes of payload.
	flagRef uint32 = 1
)

const (
	frameMagic  = 0x46504347 // "GCPF"
	frameHeader = 48
	// maxFrame bounds one frame's payload length. What a frame can make a reader allocate is
	// bounded elsewhere: a frame no receive waits for is charged to its sender's unmatched
	// bytes before it is read (Config.UnmatchedMax), one a receive waits for must have its
	// exact size and is read into it, and an abort's reason is cut at maxReason. So a
	// message of any size a tensor has (a p2p send, an all-to-all block of 2 GiB or more)
	// goes as one frame; this only refuses lengths no tensor has (2^50, as the cap's range).
	maxFrame = 1 << 50
)

// Signature identifies a collective call; ranks of a group must agree on it.
type Signature struct {
	Op     uint8
	DType  wire.DType
	RedOp  wire.RedOp
	Root   int32
	Count  uint64
	OpName string // for messages only; not on the wire
}

func (s Signature) equal(o Signature) bool {
	return s.Op == o.Op && s.DType == o.DType && s.RedOp == o.RedOp && s.Root == o.Root && s.Count == o.Count
}

// frame is a decoded header.
//
//	 0 u32 magic   4 u8 kind   5 u8 op   6 u8 dtype   7 u8 redop
//	 8 u64 seq (collective sequence number) or tag (p2p, as int64)
//	16 u32 step   20 u32 slice
//	24 i32 root   28 u32 flags
//	32 u64 count  40 u64 payload length
type frame struct {
	kind        uint8
	sig         Signature
	seq         uint64
	step, slice uint32
	length      uint64
	ref         bool // flagRef
}

func (f *frame) encode(b []byte) {
	le := binary.LittleEndian
	le.PutUint32(b[0:], frameMagic)
	b[4], b[5], b[6], b[7] = f.kind, f.sig.Op, uint8(f.sig.DType), uint8(f.sig.RedOp)
	le.PutUint64(b[8:], f.seq)
	le.PutUint32(b[16:], f.step)
	le.PutUint32(b[20:], f.slice)
	le.PutUint32(b[24:], uint32(f.sig.Root))
	var flags uint32
	if f.ref {
		flags |= flagRef
	}
	le.PutUint32(b[28:], flags)
	le.PutUint64(b[32:], f.sig.Count)
	le.PutUint64(b[40:], f.length)
}

func readFrame(r io.Reader, buf []byte) (frame, error) {
	if _, err := io.ReadFull(r, buf[:frameHeader]); err != nil {
		return frame{}, err
	}
	le := binary.LittleEndian
	if m := le.Uint32(buf); m != frameMagic {
		return frame{}, fmt.Errorf("bad frame magic %#x", m)
	}
	f := frame{
		kind: buf[4],
		sig: Signature{
			Op: buf[5], DType: wire.DType(buf[6]), RedOp: wire.RedOp(buf[7]),
			Root: int32(le.Uint32(buf[24:])), Count: le.Uint64(buf[32:]),
		},
		seq:    le.Uint64(buf[8:]),
		step:   le.Uint32(buf[16:]),
		slice:  le.Uint32(buf[20:]),
		length: le.Uint64(buf[40:]),
		ref:    le.Uint32(buf[28:])&flagRef != 0,
	}
	if f.kind < kindColl || f.kind > kindBeat {
		return frame{}, fmt.Errorf("bad frame kind %d", f.kind)
	}
	if f.length > maxFrame && !f.ref {
		return frame{}, fmt.Errorf("frame of %d bytes exceeds %d", f.length, maxFrame)
	}
	if f.ref && f.kind != kindColl && f.kind != kindP2P {
		return frame{}, fmt.Errorf("frame kind %d by reference", f.kind)
	}
	return f, nil
}
