package transport

import (
	"errors"
	"fmt"
	"net"
)

// AddressSpec is what a sidecar knows when it picks the address it listens on and tells its
// peers to dial (see ChooseAddress).
type AddressSpec struct {
	// Advertise is GOCOMM_ADVERTISE_ADDR: a host name or address of this host, taken as is.
	Advertise string
	// Ifname is GOCOMM_SOCKET_IFNAME: the interface whose address to take (as
	// NCCL_SOCKET_IFNAME names one).
	Ifname string
	// Rendezvous is the host every rank reached to bootstrap (the torch Store's host), or
	// 127.0.0.1 where the shim found every rank on this host. Empty: not known (a file
	// store shared between hosts).
	Rendezvous string
}

// ErrNoAddress: no address of this host fits what was asked.
var ErrNoAddress = errors.New("no address to advertise")

// ChooseAddress picks the address a sidecar listens on and advertises, and says why:
//  1. Advertise, where set;
//  2. else the first IPv4 (then IPv6) address of interface Ifname;
//  3. else the local address of the route to the rendezvous host: the host every peer
//     reached, so by construction one this host's peers can route to as well (loopback
//     where the rendezvous is on loopback: a one-host job listens on nothing else);
//  4. else the local address of the default route, else the first address of the first
//     interface that is up and not loopback, else 127.0.0.1.
//
// No packet is sent: a connected UDP socket only asks the kernel which source address its
// routing table picks.
func ChooseAddress(s AddressSpec) (addr, why string, err error) {
	switch {
	case s.Advertise != "":
		return s.Advertise, "GOCOMM_ADVERTISE_ADDR", nil
	case s.Ifname != "":
		a, err := interfaceAddress(s.Ifname)
		if err != nil {
			return "", "", fmt.Errorf("%w: GOCOMM_SOCKET_IFNAME=%s: %v", ErrNoAddress, s.Ifname, err)
		}
		return a, "the address of GOCOMM_SOCKET_IFNAME=" + s.Ifname, nil
	case s.Rendezvous != "":
		a, err := routeTo(s.Rendezvous)
		if err != nil {
			return "", "", fmt.Errorf("%w: no route to the rendezvous host %s (%v): set GOCOMM_ADVERTISE_ADDR or GOCOMM_SOCKET_IFNAME", ErrNoAddress, s.Rendezvous, err)
		}
		return a, "the local address of the route to the rendezvous host " + s.Rendezvous, nil
	}
	if a, err := routeTo("192.0.2.1"); err == nil { // TEST-NET-1: any address off this host
		return a, "the local address of the default route", nil
	}
	if a, err := firstUp(); err == nil {
		return a, "the first address of the first interface that is up (no default route)", nil
	}
	return "127.0.0.1", "no interface but loopback is up", nil
}

// routeTo is this host's source address towards host.
func routeTo(host string) (string, error) {
	c, err := net.Dial("udp", net.JoinHostPort(host, "9"))
	if err != nil {
		return "", err
	}
	defer c.Close()
	ip := c.LocalAddr().(*net.UDPAddr).IP
	if ip.IsUnspecified() {
		return "", fmt.Errorf("no source address towards %s", host)
	}
	return ip.String(), nil
}

// interfaceAddress is the first IPv4 address of the interface named name, else its first
// IPv6 address that is not link-local (a link-local one would need the zone in every dial).
func interfaceAddress(name string) (string, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return "", err
	}
	if ifc.Flags&net.FlagUp == 0 {
		return "", fmt.Errorf("interface %s is down", name)
	}
	addrs, err := ifc.Addrs()
	if err != nil {
		return "", err
	}
	var v6 string
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		if ipn.IP.To4() != nil {
			return ipn.IP.String(), nil
		}
		if v6 == "" && !ipn.IP.IsLinkLocalUnicast() {
			v6 = ipn.IP.String()
		}
	}
	if v6 == "" {
		return "", fmt.Errorf("interface %s has no usable address", name)
	}
	return v6, nil
}

// firstUp is the first address of the first interface (by index) that is up and not
// loopback.
func firstUp() (string, error) {
	ifcs, err := net.Interfaces()
	if err != nil {
		return "", err
	}
	for _, ifc := range ifcs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		if a, err := interfaceAddress(ifc.Name); err == nil {
			return a, nil
		}
	}
	return "", errors.New("no interface is up")
}

// unreachable is the error of a peer no dial reached: it names the peer, the address tried
// and the knobs that fix a wrong address.
func unreachable(rank int, addr string, err error) error {
	return fmt.Errorf("cannot reach rank %d's sidecar at %s (%v): that is the address rank %d's "+
		"sidecar advertised; if this host cannot route to it, set GOCOMM_ADVERTISE_ADDR (an address of that "+
		"host its peers reach) or GOCOMM_SOCKET_IFNAME (the interface to take it from) for rank %d",
		rank, addr, err, rank, rank)
}
