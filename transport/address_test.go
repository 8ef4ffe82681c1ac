package transport

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"
)

func TestChooseAddress(t *testing.T) {
	cases := []struct {
		desc string
		spec AddressSpec
		want string // "" : any address that is not unspecified
		err  bool
	}{
		{"the advertise knob wins over the rest", AddressSpec{Advertise: "10.1.2.3", Ifname: "lo", Rendezvous: "127.0.0.1"}, "10.1.2.3", false},
		{"an interface's address", AddressSpec{Ifname: "lo", Rendezvous: "192.0.2.1"}, "127.0.0.1", false},
		{"an interface that does not exist", AddressSpec{Ifname: "no-such-if0"}, "", true},
		{"a rendezvous on loopback keeps the listener on loopback", AddressSpec{Rendezvous: "127.0.0.1"}, "127.0.0.1", false},
		{"a rendezvous on localhost too", AddressSpec{Rendezvous: "localhost"}, "", false},
		{"nothing known: some address of this host", AddressSpec{}, "", false},
	}
	for _, c := range cases {
		got, why, err := ChooseAddress(c.spec)
		switch {
		case c.err:
			if !errors.Is(err, ErrNoAddress) || !strings.Contains(err.Error(), "GOCOMM_SOCKET_IFNAME") {
				t.Errorf("%s: got %q, %v; want ErrNoAddress naming the knob", c.desc, got, err)
			}
		case err != nil:
			t.Errorf("%s: %v", c.desc, err)
		case c.want != "" && got != c.want:
			t.Errorf("%s: got %s (%s), want %s", c.desc, got, why, c.want)
		case net.ParseIP(got) == nil || net.ParseIP(got).IsUnspecified() || why == "":
			t.Errorf("%s: got %q (%s)", c.desc, got, why)
		}
	}
}

// A node listens on the address it advertises, not on every interface.
func TestListenOnAdvertised(t *testing.T) {
	n, err := Listen(Config{Advertise: "127.0.0.1", Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if got := n.ln.Addr().(*net.TCPAddr).IP.String(); got != "127.0.0.1" {
		t.Fatalf("listening on %s, advertising %s", got, n.Addr())
	}
	if _, err := Listen(Config{Advertise: "192.0.2.1", Log: quiet()}); err == nil || !strings.Contains(err.Error(), "GOCOMM_ADVERTISE_ADDR") {
		t.Fatalf("an address not of this host: %v", err)
	}
}

// A peer whose advertised address takes no connection breaks the group with an error that
// names the rank, the address and the knobs; the peer, whose own link works, is told the
// same over that link instead of waiting for its timeout.
func TestUnreachablePeer(t *testing.T) {
	nodes, addrs := listen(t, 2)
	nodes[0].dialLimit = 300 * time.Millisecond
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := dead.Addr().String()
	dead.Close() // nothing listens there now: every dial is refused
	secret := []byte("a secret of at least sixteen bytes")
	ep, err := nodes[0].Join(secret, 0, []string{addrs[0], gone})
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	ep1, err := nodes[1].Join(secret, 1, addrs)
	if err != nil {
		t.Fatal(err)
	}
	defer ep1.Close()
	t0 := time.Now()
	ep1.Connect() // its link to rank 0 is up before rank 0 gives up on rank 1
	got := make([]byte, 1)
	r1 := ep1.RecvP2P(0, 0, copySink{Dst: got})
	err = ep.SendP2P(1, 0, []byte("x")).Wait(ctxT(t))
	if err == nil {
		t.Fatal("a send to an unreachable peer succeeded")
	}
	for _, want := range []string{"rank 1", gone, "GOCOMM_ADVERTISE_ADDR", "GOCOMM_SOCKET_IFNAME"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	err1 := r1.Wait(ctxT(t))
	if !errors.Is(err1, ErrAborted) || !strings.Contains(err1.Error(), gone) {
		t.Errorf("rank 1: %v, want rank 0's abort naming %s", err1, gone)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Errorf("took %s to fail, dial limit 300ms", d)
	}
}
