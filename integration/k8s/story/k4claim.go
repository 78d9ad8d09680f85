package story

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// What the scenarios after K4 share: K4's claim, the disks' handles and
// the agents' claims and events.

// ownDisk is the PV and volume handle of a StatefulSet pod p's claim
// (data-<pod>), refused when handles (handle -> pod) has another pod's
// claim on the same disk; p's is added to it.
func (s *story) ownDisk(ctx context.Context, p podInfo, handles map[string]string) (string, string, error) {
	pv, err := s.pvOf(ctx, "data-"+p.Name)
	if err != nil {
		return "", "", err
	}
	h, err := s.handle(ctx, pv)
	if err != nil {
		return "", "", err
	}
	if other, dup := handles[h]; dup {
		return "", "", fmt.Errorf("the claims of %s and %s are one disk %s", other, p.Name, h)
	}
	handles[h] = p.Name
	return pv, h, nil
}

// handle is pv's CSI volume handle.
func (s *story) handle(ctx context.Context, pv string) (string, error) {
	h, err := s.c.Kubectl(ctx, "get", "pv", pv, "-o", "jsonpath={.spec.csi.volumeHandle}")
	h = strings.TrimSpace(h)
	if err == nil && h == "" {
		err = fmt.Errorf("PV %s has no CSI volume handle", pv)
	}
	return h, err
}

// diskOf is the disk id of a volume handle (location/disk).
func diskOf(handle string) (int64, error) {
	_, id, ok := strings.Cut(handle, "/")
	n, err := strconv.ParseInt(id, 10, 64)
	if !ok || err != nil {
		return 0, fmt.Errorf("volume handle %q is not <location>/<disk id>", handle)
	}
	return n, nil
}

// nodeEvents are the events of the agent on g (the .deb's vco-agent on
// its default socket).
func nodeEvents(ctx context.Context, g *lab.Guest) ([]simlab.Event, error) {
	out, err := g.MustSh(ctx, "vco-agent events --json")
	if err != nil {
		return nil, err
	}
	var evs []simlab.Event
	for _, line := range strings.Split(out, "\n") {
		if line = strings.TrimSpace(line); line == "" {
			continue
		}
		var ev simlab.Event
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			return nil, fmt.Errorf("%s: vco-agent events printed %q: %w", g.Name, line, err)
		}
		ev.Node = g.Name
		evs = append(evs, ev)
	}
	return evs, nil
}

// claimKey is the fence key g's agent claimed volume with: the holder key
// of its last DiskClaimed event for it.
func claimKey(ctx context.Context, g *lab.Guest, volume string) (string, error) {
	evs, err := nodeEvents(ctx, g)
	if err != nil {
		return "", err
	}
	key := ""
	for _, ev := range evs {
		if ev.Name() == "DiskClaimed" && ev.Volume == volume {
			key = ev.HolderKey
		}
	}
	if key == "" {
		return "", fmt.Errorf("%s's agent has no DiskClaimed event for %s", g.Name, volume)
	}
	return key, nil
}

// k4Claim is what the scenarios after K4 work on: its running pod and its
// claim's PV, volume handle and disk.
type k4Claim struct {
	pod        podInfo
	pv, handle string
	disk       int64
}

func (s *story) k4Volume(ctx context.Context, sc string) (*k4Claim, error) {
	ps, err := s.pods(ctx, "app=k4")
	if err != nil {
		return nil, err
	}
	if len(ps) != 1 || !ps[0].Ready {
		return nil, fmt.Errorf("%s needs K4's pod running: %+v", sc, ps)
	}
	k := &k4Claim{pod: ps[0]}
	if k.pv, err = s.pvOf(ctx, "k4"); err != nil {
		return nil, err
	}
	if k.handle, err = s.handle(ctx, k.pv); err != nil {
		return nil, err
	}
	if k.disk, err = diskOf(k.handle); err != nil {
		return nil, err
	}
	return k, nil
}
