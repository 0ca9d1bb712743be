package outbound

import (
	"errors"
	"fmt"
	"net/netip"
	"syscall"
)

// ErrScheme refuses an endpoint URL that is not http or https.
var ErrScheme = errors.New("outbound: URL scheme not allowed")

// AddressError is a connection the dispatcher refused to open because the
// endpoint's host resolved to an address of a forbidden range (loopback,
// private, link-local and cloud metadata, carrier-grade NAT, multicast,
// unspecified or reserved) outside DispatcherConfig.AllowNetworks. The
// delivery is dead at once: such an endpoint is a misconfiguration or an
// attack, not a transient failure.
type AddressError struct {
	Addr   netip.Addr
	Reason string // e.g. "loopback"
}

func (e *AddressError) Error() string {
	return fmt.Sprintf("outbound: refusing to connect to %s: %s address (not in DispatcherConfig.AllowNetworks)", e.Addr, e.Reason)
}

// forbidden are the ranges refused unless allow-listed, besides what
// netip.Addr's predicates catch. IPv4-mapped IPv6 addresses are unmapped and
// IPv4 addresses embedded in NAT64 and 6to4 addresses are checked too.
var forbidden = []struct {
	prefix netip.Prefix
	reason string
}{
	{netip.MustParsePrefix("0.0.0.0/8"), "unspecified (\"this network\")"},
	{netip.MustParsePrefix("10.0.0.0/8"), "private"},
	{netip.MustParsePrefix("100.64.0.0/10"), "carrier-grade NAT"},
	{netip.MustParsePrefix("127.0.0.0/8"), "loopback"},
	{netip.MustParsePrefix("169.254.0.0/16"), "link-local (cloud metadata)"},
	{netip.MustParsePrefix("172.16.0.0/12"), "private"},
	{netip.MustParsePrefix("192.0.0.0/24"), "IETF protocol assignment"},
	{netip.MustParsePrefix("192.168.0.0/16"), "private"},
	{netip.MustParsePrefix("198.18.0.0/15"), "benchmarking"},
	{netip.MustParsePrefix("224.0.0.0/4"), "multicast"},
	{netip.MustParsePrefix("240.0.0.0/4"), "reserved"},
	{netip.MustParsePrefix("::/128"), "unspecified"},
	{netip.MustParsePrefix("::1/128"), "loopback"},
	{netip.MustParsePrefix("64:ff9b:1::/48"), "local-use NAT64"},
	{netip.MustParsePrefix("2001::/32"), "Teredo"},
	{netip.MustParsePrefix("fc00::/7"), "unique local (private)"},
	{netip.MustParsePrefix("fe80::/10"), "link-local"},
	{netip.MustParsePrefix("fec0::/10"), "site-local"},
	{netip.MustParsePrefix("ff00::/8"), "multicast"},
}

var (
	nat64   = netip.MustParsePrefix("64:ff9b::/96")
	sixToFo = netip.MustParsePrefix("2002::/16")
)

// guard decides which addresses the dispatcher may connect to.
type guard struct{ allow []netip.Prefix }

// check returns an *AddressError if a may not be dialled.
func (g guard) check(a netip.Addr) error {
	a = a.WithZone("") // prefixes never contain zoned addresses
	for _, p := range g.allow {
		if p.Contains(a) || (a.Is4In6() && p.Contains(a.Unmap())) {
			return nil
		}
	}
	if reason := forbiddenReason(a); reason != "" {
		return &AddressError{Addr: a, Reason: reason}
	}
	return nil
}

func forbiddenReason(a netip.Addr) string {
	a = a.Unmap()
	if !a.IsValid() {
		return "invalid"
	}
	for _, f := range forbidden {
		if f.prefix.Contains(a) {
			return f.reason
		}
	}
	switch {
	case a.IsLoopback():
		return "loopback"
	case a.IsPrivate():
		return "private"
	case a.IsLinkLocalUnicast(), a.IsLinkLocalMulticast():
		return "link-local"
	case a.IsMulticast(), a.IsInterfaceLocalMulticast():
		return "multicast"
	case a.IsUnspecified():
		return "unspecified"
	}
	if a.Is6() {
		b := a.As16()
		var v4 netip.Addr
		switch {
		case nat64.Contains(a):
			v4 = netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]})
		case sixToFo.Contains(a):
			v4 = netip.AddrFrom4([4]byte{b[2], b[3], b[4], b[5]})
		}
		if v4.IsValid() {
			if r := forbiddenReason(v4); r != "" {
				return r + " (embedded in " + a.String() + ")"
			}
		}
	}
	return ""
}

// control is a net.Dialer.Control: it runs after the host name was resolved
// and before the connection is made, on the very address being dialled, so a
// DNS answer that changes between a check and the dial (rebinding) cannot
// slip through.
func (g guard) control(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("outbound: refusing to connect to %q (%s): cannot parse the address: %w", address, network, err)
	}
	return g.check(ap.Addr())
}
