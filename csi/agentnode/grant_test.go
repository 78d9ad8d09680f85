package agentnode

import (
	"reflect"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/fence"
)

// TestGrantPassesThrough: the controller's grant reaches the agent's API
// type field for field; the agent checks it, not the plugin.
func TestGrantPassesThrough(t *testing.T) {
	issued := (&fence.Grant{Disk: "loc/7", Node: "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab", Supersedes: []fence.Key{0x7663a1b2c3d4e5f6, 0x7663000000000001}}).Encode()
	for _, c := range []struct {
		raw                string
		disk, node         string
		supersedes         []string
		wantInvalidRequest bool
	}{
		{raw: issued, disk: "loc/7", node: "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab", supersedes: []string{"0x7663a1b2c3d4e5f6", "0x7663000000000001"}},
		// What only the agent can judge goes to it unchanged.
		{raw: `{"disk":"loc/7","node":"not-a-uuid","supersedes":["zz"],"from_a_newer_controller":1}`, disk: "loc/7", node: "not-a-uuid", supersedes: []string{"zz"}},
		{raw: `{"disk":`, wantInvalidRequest: true},
		{raw: `["loc/7"]`, wantInvalidRequest: true},
	} {
		g, err := grant("loc/7", map[string]string{driver.PubFenceGrant: c.raw})
		if c.wantInvalidRequest {
			if status.Code(err) != codes.InvalidArgument {
				t.Errorf("%s: %+v, %v; want InvalidArgument", c.raw, g, err)
			}
			continue
		}
		if err != nil || g.GetDisk() != c.disk || g.GetNode() != c.node || !reflect.DeepEqual(g.GetSupersedes(), c.supersedes) {
			t.Errorf("%s: %+v, %v", c.raw, g, err)
		}
	}
	if g, err := grant("loc/7", map[string]string{}); g != nil || err != nil {
		t.Errorf("no grant: %+v, %v", g, err)
	}
}
