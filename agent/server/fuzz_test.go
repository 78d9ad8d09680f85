package server

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

// FuzzStageVolumeRequest feeds arbitrary wire bytes through the same
// decoding and checks a StageVolume call gets before it touches a disk:
// proto unmarshal, the device locator and the takeover grant. Whatever the
// bytes, the request is either refused with InvalidArgument or converted
// into a locator that the claim records can parse back.
func FuzzStageVolumeRequest(f *testing.F) {
	for _, r := range []*api.StageVolumeRequest{
		{VolumeId: "loc/1", Device: &api.DeviceLocator{HasPci: true, PciBus: 0, PciSlot: 7, Serial: "42"}, StagingPath: "/var/lib/kubelet/s", FsType: "ext4"},
		{VolumeId: "v", Device: &api.DeviceLocator{PciAddress: "0000:00:07.0", Wwn: "naa.6001405f"}, Block: true},
		{VolumeId: "v", Device: &api.DeviceLocator{Serial: "a,b=c"}},
		{VolumeId: "v\x00", Device: &api.DeviceLocator{LoopBackingFile: "/../etc/passwd"}, StagingPath: "/var/lib/kubelet/../../etc"},
		{VolumeId: "v", Grant: &api.TakeoverGrant{Disk: "loc/1", Node: "4c4c4544-0042-3610-8052-b4c04f4e3332", Supersedes: []string{"0x7663a1b2c3d4e5f6"}}},
		{VolumeId: "v", Encryption: &api.Encryption{Passphrase: []byte("secret"), FormatIfBlank: true}, MountFlags: []string{"noatime", "a,b"}},
	} {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var req api.StageVolumeRequest
		if err := proto.Unmarshal(b, &req); err != nil {
			return
		}
		if req.GetDevice() != nil {
			loc, err := LocatorFromAPI(req.GetDevice())
			if err != nil {
				if agenterr.Code(err) != codes.InvalidArgument {
					t.Fatalf("locator %v: %v, want InvalidArgument", req.GetDevice(), err)
				}
			} else if !loc.Disk.IsZero() {
				// Claims record the locator as its text form.
				text, err := loc.Disk.MarshalText()
				if err != nil {
					t.Fatalf("locator %v became %+v, which has no text form: %v", req.GetDevice(), loc.Disk, err)
				}
				var back discovery.Locator
				if err := back.UnmarshalText(text); err != nil || !back.Equal(loc.Disk) {
					t.Fatalf("locator %v became %q, which reads back as %+v: %v", req.GetDevice(), text, back, err)
				}
			}
		}
		g, err := GrantFromAPI(req.GetGrant())
		if err != nil {
			if agenterr.Code(err) != codes.InvalidArgument {
				t.Fatalf("grant %v: %v, want InvalidArgument", req.GetGrant(), err)
			}
			return
		}
		if g != nil && (g.Disk == "" || len(g.Supersedes) == 0 || g.Node == "") {
			t.Fatalf("grant %v accepted incomplete: %+v", req.GetGrant(), g)
		}
		if g != nil {
			for _, k := range g.Supersedes {
				if k == 0 {
					t.Fatalf("grant %v accepted the zero key", req.GetGrant())
				}
			}
		}
	})
}

// FuzzVolumeRequests unmarshals the other volume requests: none may panic
// the decoder or the locator check on arbitrary bytes.
func FuzzVolumeRequests(f *testing.F) {
	f.Add(uint8(0), []byte{})
	for i, m := range []proto.Message{
		&api.UnstageVolumeRequest{VolumeId: "v", StagingPath: "/k/s"},
		&api.PublishVolumeRequest{VolumeId: "v", StagingPath: "/k/s", TargetPath: "/k/t", MountFlags: []string{"ro"}},
		&api.UnpublishVolumeRequest{VolumeId: "v", TargetPath: "/k/t"},
		&api.ExpandVolumeRequest{VolumeId: "v", VolumePath: "/k/t", RequiredBytes: 1 << 62},
		&api.GetVolumeStatsRequest{VolumeId: "v", VolumePath: "/k/t"},
	} {
		b, _ := proto.Marshal(m)
		f.Add(uint8(i), b)
	}
	f.Fuzz(func(t *testing.T, which uint8, b []byte) {
		msgs := []proto.Message{&api.UnstageVolumeRequest{}, &api.PublishVolumeRequest{}, &api.UnpublishVolumeRequest{},
			&api.ExpandVolumeRequest{}, &api.GetVolumeStatsRequest{}, &api.ListDisksRequest{}}
		m := msgs[int(which)%len(msgs)]
		if err := proto.Unmarshal(b, m); err != nil {
			return
		}
		// What decodes must encode again and decode to the same message.
		out, err := proto.Marshal(m)
		if err != nil {
			t.Fatalf("%T: re-encoding: %v", m, err)
		}
		back := m.ProtoReflect().New().Interface()
		if err := proto.Unmarshal(out, back); err != nil || !proto.Equal(m, back) {
			t.Fatalf("%T: round trip: %v", m, err)
		}
	})
}
