package outbound

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"syscall"
)

// ErrScheme refuses an endpoint URL that is not http or https.
var ErrScheme = errors.New("outbound: URL scheme not allowed")

// AddressError is a connection the dispatcher refused to open because the
// endpoint's host resolved to an address of a forbidden range (loopback,
// private, link-local and cloud metadata, carrier-grade NAT, multicast,
// unspecified, reserved or documentation, and every IPv6 form that embeds
// such an IPv4 address) outside DispatcherConfig.AllowNetworks. A cloud
// metadata or platform address is refused unless AllowNetworks lists it as
// a single address. The
// delivery is dead at once: such an endpoint is a misconfiguration or an
// attack, not a transient failure.
type AddressError struct {
	Addr   netip.Addr
	Reason string // e.g. "loopback"
}

func (e *AddressError) Error() string {
	return fmt.Sprintf("outbound: refusing to connect to %s: %s address (not in DispatcherConfig.AllowNetworks)", e.Addr, e.Reason)
}

// metadata are the cloud metadata and platform endpoints. They are refused
// even inside an allow-listed range: only an AllowNetworks prefix that is
// this single address opens one.
var metadata = map[netip.Addr]string{
	netip.MustParseAddr("169.254.169.254"): "cloud metadata (AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle)",
	netip.MustParseAddr("169.254.170.2"):   "cloud metadata (AWS ECS task credentials)",
	netip.MustParseAddr("169.254.170.23"):  "cloud metadata (AWS EKS pod identity)",
	netip.MustParseAddr("169.254.0.23"):    "cloud metadata (Tencent Cloud)",
	netip.MustParseAddr("fd00:ec2::254"):   "cloud metadata (AWS IMDS over IPv6)",
	netip.MustParseAddr("fd00:ec2::23"):    "cloud metadata (AWS EKS pod identity over IPv6)",
	netip.MustParseAddr("fd20:ce::254"):    "cloud metadata (GCP over IPv6)",
	netip.MustParseAddr("168.63.129.16"):   "cloud platform (Azure WireServer)",
	netip.MustParseAddr("100.100.100.200"): "cloud metadata (Alibaba Cloud)",
	netip.MustParseAddr("192.0.0.192"):     "cloud metadata (Oracle Cloud)",
}

// metadataHosts are the names of metadata endpoints, refused before they
// are resolved (whatever they resolve to on this network).
var metadataHosts = map[string]bool{
	"metadata.google.internal":     true,
	"metadata.goog":                true,
	"metadata":                     true,
	"instance-data":                true,
	"instance-data.ec2.internal":   true,
	"metadata.azure.internal":      true,
	"metadata.tencentyun.com":      true,
	"metadata.platformequinix.com": true,
}

// forbidden are the ranges refused unless allow-listed, besides what
// netip.Addr's predicates catch.
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
	{netip.MustParsePrefix("192.0.2.0/24"), "documentation"},
	{netip.MustParsePrefix("192.88.99.0/24"), "6to4 relay anycast"},
	{netip.MustParsePrefix("192.168.0.0/16"), "private"},
	{netip.MustParsePrefix("198.18.0.0/15"), "benchmarking"},
	{netip.MustParsePrefix("198.51.100.0/24"), "documentation"},
	{netip.MustParsePrefix("203.0.113.0/24"), "documentation"},
	{netip.MustParsePrefix("224.0.0.0/4"), "multicast"},
	{netip.MustParsePrefix("240.0.0.0/4"), "reserved"},
	{netip.MustParsePrefix("::/128"), "unspecified"},
	{netip.MustParsePrefix("::1/128"), "loopback"},
	{netip.MustParsePrefix("100::/64"), "discard-only"},
	{netip.MustParsePrefix("2001:db8::/32"), "documentation"},
	{netip.MustParsePrefix("fc00::/7"), "unique local (private)"},
	{netip.MustParsePrefix("fe80::/10"), "link-local"},
	{netip.MustParsePrefix("fec0::/10"), "site-local"},
	{netip.MustParsePrefix("ff00::/8"), "multicast"},
}

// The IPv6 forms that carry an IPv4 address. Each is refused when the IPv4
// address it embeds is; the forms that no public endpoint uses are refused
// whatever they embed.
var (
	ipv4Compatible = netip.MustParsePrefix("::/96")           // ::a.b.c.d, deprecated (RFC 4291)
	ipv4Translated = netip.MustParsePrefix("::ffff:0:0:0/96") // ::ffff:0:a.b.c.d, SIIT (RFC 2765)
	nat64          = netip.MustParsePrefix("64:ff9b::/96")    // well-known NAT64 prefix (RFC 6052)
	nat64Local     = netip.MustParsePrefix("64:ff9b:1::/48")  // local-use NAT64 (RFC 8215)
	sixToFour      = netip.MustParsePrefix("2002::/16")       // 6to4 (RFC 3056)
	teredo         = netip.MustParsePrefix("2001::/32")       // Teredo (RFC 4380)
)

// guard decides which addresses the dispatcher may connect to.
type guard struct{ allow []netip.Prefix }

// check returns an *AddressError if a may not be dialled.
func (g guard) check(a netip.Addr) error {
	a = a.WithZone("") // prefixes never contain zoned addresses
	if meta := metadataAddr(a.Unmap()); meta.IsValid() {
		for _, p := range g.allow {
			if p.IsSingleIP() && p.Addr().Unmap() == a.Unmap() {
				return nil
			}
		}
		return &AddressError{Addr: a, Reason: forbiddenReason(a)}
	}
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
	a = a.Unmap() // IPv4-mapped, ::ffff:a.b.c.d
	if !a.IsValid() {
		return "invalid"
	}
	if reason, ok := metadata[a]; ok {
		return reason
	}
	if a.Is6() {
		if v4, form, whole := embeddedIPv4(a); v4.IsValid() {
			if r := forbiddenReason(v4); r != "" {
				return r + " (" + v4.String() + " embedded in a " + form + " address)"
			}
			if whole {
				return form + " (IPv4-embedding form no public endpoint uses)"
			}
		}
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
	return ""
}

// metadataAddr returns the metadata address that a is or embeds, or an
// invalid address.
func metadataAddr(a netip.Addr) netip.Addr {
	if _, ok := metadata[a]; ok {
		return a
	}
	if a.Is6() {
		if v4, _, _ := embeddedIPv4(a); v4.IsValid() {
			if _, ok := metadata[v4]; ok {
				return v4
			}
		}
	}
	return netip.Addr{}
}

// embeddedIPv4 returns the IPv4 address that the IPv6 address a carries,
// the name of the form, and whether the form is refused whatever it
// carries. It returns an invalid address for an IPv6 address of no such
// form.
func embeddedIPv4(a netip.Addr) (v4 netip.Addr, form string, whole bool) {
	b := a.As16()
	last := netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]})
	switch {
	case a == netip.IPv6Unspecified() || a == netip.IPv6Loopback():
		return netip.Addr{}, "", false // ::, ::1: not IPv4-compatible (RFC 4291)
	case ipv4Compatible.Contains(a):
		return last, "IPv4-compatible", true
	case ipv4Translated.Contains(a):
		return last, "IPv4-translated", true
	case nat64.Contains(a):
		return last, "NAT64", false
	case nat64Local.Contains(a):
		// RFC 6052 with a /48 prefix: the IPv4 address is in bytes 6, 7
		// and, after the reserved byte 8, 9 and 10.
		return netip.AddrFrom4([4]byte{b[6], b[7], b[9], b[10]}), "local-use NAT64", true
	case sixToFour.Contains(a):
		return netip.AddrFrom4([4]byte{b[2], b[3], b[4], b[5]}), "6to4", false
	case teredo.Contains(a):
		// The client's public address, inverted, in the last 32 bits.
		return netip.AddrFrom4([4]byte{^b[12], ^b[13], ^b[14], ^b[15]}), "Teredo", true
	case b[8]&^0x02 == 0 && b[9] == 0 && b[10] == 0x5e && b[11] == 0xfe:
		// ISATAP interface identifier (RFC 5214), under any prefix.
		return last, "ISATAP", false
	}
	return netip.Addr{}, "", false
}

// checkHost refuses the names of cloud metadata endpoints before they are
// resolved.
func checkHost(host string) error {
	h := strings.TrimSuffix(strings.ToLower(host), ".")
	if metadataHosts[h] {
		return &HostError{Host: host}
	}
	return nil
}

// HostError is an endpoint whose host is the name of a cloud metadata
// endpoint: refused before it is resolved, whatever DispatcherConfig
// allows. Like an AddressError, the delivery is dead at once.
type HostError struct{ Host string }

func (e *HostError) Error() string {
	return fmt.Sprintf("outbound: refusing to connect to %s: the name of a cloud metadata endpoint", e.Host)
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
