package collectives

import (
	"context"
	"fmt"
)

// AllToAll sends inSplits[j] bytes of in (blocks in rank order) to rank j and receives
// outSplits[j] bytes from rank j into out (blocks in rank order). Every pair exchanges one
// message, empty ones included, so a rank whose splits disagree with its peer's fails with a
// mismatch naming both sizes. Sends start with rank r+1, r+2, ... so ranks do not all send
// to the same peer at once.
func AllToAll(ctx context.Context, c Comm, in []byte, inSplits []int, out []byte, outSplits []int) error {
	n, r := c.Size(), c.Rank()
	if len(inSplits) != n || len(outSplits) != n {
		return fmt.Errorf("all_to_all: %d input and %d output splits for %d ranks: %w", len(inSplits), len(outSplits), n, errSize)
	}
	inOff, err := offsets(inSplits, len(in))
	if err != nil {
		return fmt.Errorf("all_to_all: input: %w", err)
	}
	outOff, err := offsets(outSplits, len(out))
	if err != nil {
		return fmt.Errorf("all_to_all: output: %w", err)
	}
	if inSplits[r] != outSplits[r] {
		return fmt.Errorf("all_to_all: rank %d sends itself %d bytes but expects %d: %w", r, inSplits[r], outSplits[r], errSize)
	}
	copy(out[outOff[r]:outOff[r+1]], in[inOff[r]:inOff[r+1]])
	var reqs []Request
	for s := 1; s < n; s++ {
		from := mod(r-s, n)
		reqs = append(reqs, c.Recv(from, Tag{}, CopySink{out[outOff[from]:outOff[from+1]]}))
	}
	for s := 1; s < n; s++ {
		to := mod(r+s, n)
		reqs = append(reqs, c.Send(to, Tag{}, in[inOff[to]:inOff[to+1]]))
	}
	return waitAll(ctx, reqs)
}

// offsets turns split sizes into n+1 offsets and checks they cover exactly total bytes.
func offsets(splits []int, total int) ([]int, error) {
	off := make([]int, len(splits)+1)
	for i, s := range splits {
		if s < 0 {
			return nil, fmt.Errorf("split %d is negative (%d): %w", i, s, errSize)
		}
		off[i+1] = off[i] + s
		if off[i+1] > total {
			return nil, fmt.Errorf("splits add up to more than the %d bytes of the buffer: %w", total, errSize)
		}
	}
	if off[len(splits)] != total {
		return nil, fmt.Errorf("splits add up to %d bytes, the buffer has %d: %w", off[len(splits)], total, errSize)
	}
	return off, nil
}

// Barrier returns once every rank of the group has entered it (dissemination barrier: in
// round k each rank signals rank r+2^k and waits for rank r-2^k; log2(n) rounds).
func Barrier(ctx context.Context, c Comm) error {
	n, r := c.Size(), c.Rank()
	for k, step := 1, uint32(0); k < n; k, step = k<<1, step+1 {
		reqs := []Request{
			c.Send(mod(r+k, n), Tag{Step: step}, nil),
			c.Recv(mod(r-k, n), Tag{Step: step}, CopySink{}),
		}
		if err := waitAll(ctx, reqs); err != nil {
			return err
		}
	}
	return nil
}
