// Package drivername derives the CSI driver's default name from the
// whitesky.cloud portal's host name.
package drivername

import (
	"net"
	"strings"
)

// FromPortal derives the default driver name from the portal host:
// reverse the domain and replace the leaf with "csi", so
// try.whitesky.cloud becomes cloud.whitesky.csi. An IP address or a
// single-label host has no domain to derive from: the answer is "", and the
// name must be configured.
func FromPortal(host string) string {
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if net.ParseIP(host) != nil {
		return ""
	}
	parts := strings.Split(host, ".")
	if len(parts) < 2 {
		return ""
	}
	parts = parts[1:]
	out := make([]string, 0, len(parts)+1)
	for i := len(parts) - 1; i >= 0; i-- {
		out = append(out, parts[i])
	}
	return strings.Join(append(out, "csi"), ".")
}
