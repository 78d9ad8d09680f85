package server

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/peercred"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

func TestLocatorFromAPI(t *testing.T) {
	cases := []struct {
		in            *api.DeviceLocator
		disk, backing string
	}{
		{&api.DeviceLocator{HasPci: true, PciBus: 0, PciSlot: 7, Serial: "42"}, "pci=0000:00:07,serial=42", ""},
		{&api.DeviceLocator{PciAddress: "00:07.0", Wwn: "naa.6001405f"}, "pci=0000:00:07.0,wwn=naa.6001405f", ""},
		{&api.DeviceLocator{Serial: "abc"}, "serial=abc", ""},
		{&api.DeviceLocator{Serial: "  abc  "}, "serial=abc", ""},
		{&api.DeviceLocator{LoopBackingFile: "/srv/disk-1.img"}, "", "/srv/disk-1.img"},
	}
	for _, c := range cases {
		got, err := LocatorFromAPI(c.in)
		if err != nil || got.Disk.String() != c.disk || got.BackingFile != c.backing {
			t.Errorf("%v: %+v %v, want disk %q, backing file %q", c.in, got, err, c.disk, c.backing)
			continue
		}
		if c.disk == "" {
			continue
		}
		// The locator is recorded as its text form, which must read back
		// as the same locator.
		back, err := discovery.ParseLocator(c.disk)
		if err != nil || !back.Equal(got.Disk) {
			t.Errorf("%v: %q reads back as %+v, %v", c.in, c.disk, back, err)
		}
	}
	for _, bad := range []*api.DeviceLocator{nil, {PciAddress: "zz"}, {HasPci: true, PciSlot: 40}, {Serial: "a,b"}, {Wwn: "x=y"}, {Serial: "a\x00b"}} {
		if _, err := LocatorFromAPI(bad); agenterr.Code(err) != codes.InvalidArgument {
			t.Errorf("%v: %v, want InvalidArgument", bad, err)
		}
	}
}

func TestGrantFromAPI(t *testing.T) {
	const node = "4C4C4544-0042-3610-8052-B4C04F4E3332"
	g, err := GrantFromAPI(&api.TakeoverGrant{Disk: "loc/1", Node: node, Supersedes: []string{"7663a1b2c3d4e5f6", "0x7663000000000001"}})
	if err != nil || g.Disk != "loc/1" || g.Node != strings.ToLower(node) || len(g.Supersedes) != 2 || !g.Names(fence.Key(0x7663a1b2c3d4e5f6)) {
		t.Fatalf("grant: %+v %v", g, err)
	}
	if g, err := GrantFromAPI(nil); g != nil || err != nil {
		t.Fatalf("no grant: %+v %v", g, err)
	}
	for _, bad := range []*api.TakeoverGrant{
		{Disk: "d", Node: "nope", Supersedes: []string{"1"}},
		{Disk: "d", Node: node},
		{Node: node, Supersedes: []string{"1"}},
		{Disk: "d", Node: node, Supersedes: []string{"0"}},
	} {
		if _, err := GrantFromAPI(bad); agenterr.Code(err) != codes.InvalidArgument {
			t.Errorf("%v: %v, want InvalidArgument", bad, err)
		}
	}
}

// A server started without a volume manager answers every volume method
// with Unavailable and a sentence, over the real socket.
func TestVolumeMethodsWithoutManager(t *testing.T) {
	f := serve(t, peercred.Policy{GID: -1})
	ctx := context.Background()
	_, err := f.c.StageVolume(ctx, &api.StageVolumeRequest{VolumeId: "v"})
	if st := status.Convert(err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "no volume methods") {
		t.Fatalf("stage: %v", err)
	}
	if _, err := f.c.ListDisks(ctx, &api.ListDisksRequest{}); status.Code(err) != codes.Unavailable {
		t.Fatalf("list: %v", err)
	}
}
