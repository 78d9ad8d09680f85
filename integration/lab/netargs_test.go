package lab

import (
	"strings"
	"testing"
)

func TestNetArgsForwardsBothWays(t *testing.T) {
	if got := netArgs(GuestConfig{}); strings.Join(got, " ") != "-nic none" {
		t.Errorf("no forwards: %v, want no NIC", got)
	}
	got := strings.Join(netArgs(GuestConfig{
		Forwards: []Forward{{GuestAddr: "10.0.2.100:6443", HostPort: 40001}},
		Inbound:  []Inbound{{HostPort: 40002, GuestPort: 10250}},
	}), " ")
	for _, want := range []string{"restrict=on", ",guestfwd=tcp:10.0.2.100:6443-cmd:busybox nc 127.0.0.1 40001",
		",hostfwd=tcp:127.0.0.1:40002-:10250", "virtio-net-pci,netdev=net0,mac=52:54:00:12:34:56"} {
		if !strings.Contains(got, want) {
			t.Errorf("netArgs %q lacks %q", got, want)
		}
	}
	// A guest reached only from the host still gets its NIC.
	if got := strings.Join(netArgs(GuestConfig{Inbound: []Inbound{{HostPort: 40003, GuestPort: 22}}}), " "); !strings.Contains(got, "hostfwd=tcp:127.0.0.1:40003-:22") {
		t.Errorf("inbound only: %q", got)
	}
}
