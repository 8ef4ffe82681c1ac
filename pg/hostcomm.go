package pg

import (
	"github.com/gocomm/gocomm/collectives"
	"github.com/gocomm/gocomm/transport"
)

// hostComm gives a host collective's algorithm (collectives) the group's peer links
// (transport) for one op; neither package knows the other.
type hostComm struct{ c *transport.OpComm }

func (h hostComm) Rank() int { return h.c.Rank() }
func (h hostComm) Size() int { return h.c.Size() }

func (h hostComm) Send(to int, t collectives.Tag, data []byte) collectives.Request {
	return h.c.Send(to, transport.Tag(t), data)
}

func (h hostComm) Recv(from int, t collectives.Tag, s collectives.Sink) collectives.Request {
	return h.c.Recv(from, transport.Tag(t), s)
}
