package story

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
)

// k3: a StatefulSet of two replicas with volumeClaimTemplates, one per
// worker: a disk each, each writable, each mounted on its own node only.
func (s *story) k3(ctx context.Context) error {
	const sc = "K3"
	var ps []podInfo
	aff := `affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - labelSelector: {matchLabels: {app: k3}}
        topologyKey: kubernetes.io/hostname
`
	if err := s.step(sc, "cluster", "StatefulSet of 2 replicas with volumeClaimTemplates of the seed's class vco-csi-physical (diskType: PHYSICAL), one per worker", func() (string, error) {
		if err := s.apply(ctx, statefulSet("k3", 2, "vco-csi-physical", aff)); err != nil {
			return "", err
		}
		var err error
		ps, err = s.waitPods(ctx, "app=k3", 10*time.Minute, "both k3 replicas Ready", allReady(2))
		if err != nil {
			return "", err
		}
		if ps[0].Node == ps[1].Node {
			return "", fmt.Errorf("both replicas on %s", ps[0].Node)
		}
		return fmt.Sprintf("%s on %s, %s on %s", ps[0].Name, ps[0].Node, ps[1].Name, ps[1].Node), nil
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "a PHYSICAL disk each, each holding what its pod wrote, mounted only on its node", func() (string, error) {
		var got []string
		handles := map[string]string{}
		for _, p := range ps {
			pv, h, err := s.ownDisk(ctx, p, handles)
			if err != nil {
				return "", err
			}
			id, err := diskOf(h)
			if err != nil {
				return "", err
			}
			if d := s.c.Env.Sim.Snapshot().Disks[id]; d == nil || d.Type != "PHYSICAL" {
				return "", fmt.Errorf("%s's disk %s is not the PHYSICAL disk its class vco-csi-physical asks for: %+v", p.Name, h, d)
			}
			data, err := s.readLog(ctx, p, pv)
			if err != nil {
				return "", err
			}
			if data != "written-on-"+p.Node {
				return "", fmt.Errorf("%s's volume %s holds %q", p.Name, pv, data)
			}
			elsewhere, err := s.mountsOf(ctx, s.c.Env.Lab.Guest(s.other(p.Node)), pv)
			if err != nil {
				return "", err
			}
			s.check(e2e.P1, sc, len(elsewhere) == 0, "K3: %s's disk %s is mounted on %s only (mounts on the other worker: %d)", p.Name, h, p.Node, len(elsewhere))
			if len(elsewhere) > 0 {
				return "", fmt.Errorf("%s mounted on the other worker: %v", pv, elsewhere)
			}
			got = append(got, fmt.Sprintf("%s: PHYSICAL disk %s on %s", p.Name, h, p.Node))
		}
		// The claims outlive the StatefulSet; both go, freeing their disks.
		if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "statefulset", "k3", "--wait=true"); err != nil {
			return "", err
		}
		if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", "data-k3-0", "data-k3-1", "--wait=false"); err != nil {
			return "", err
		}
		return strings.Join(got, "; "), nil
	})
}
