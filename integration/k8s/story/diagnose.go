package story

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/srctree"
)

// diagnosisCommand is docs/diagnosis.md's first command, the agent's list
// of disks through a node debug pod, as the page has it: the test fails
// when the page no longer has it.
var diagnosisCommand = regexp.MustCompile(`(?m)^kubectl debug node/<node> -n csi-driver -it --image=(\S+) -- chroot /host vco-agent disks$`)

// diagnose runs docs/diagnosis.md's `kubectl debug node/... -- chroot
// /host vco-agent disks` on node, with the lab's busybox image for the
// page's and without -it (nobody types into it here), and checks that the
// agent's list names the volume of every claim staged there. The debug
// pod is deleted, as the page says to.
func (s *story) diagnose(ctx context.Context, node string) (string, error) {
	page, err := os.ReadFile(filepath.Join(srctree.Root(), "docs", "diagnosis.md"))
	if err != nil {
		return "", err
	}
	m := diagnosisCommand.FindSubmatch(page)
	if m == nil {
		return "", fmt.Errorf("docs/diagnosis.md no longer has %q", diagnosisCommand)
	}
	out, err := s.c.Kubectl(ctx, "debug", "node/"+node, "-n", k8s.AddonNamespace, "--image="+WorkloadImage, "--", "chroot", "/host", "vco-agent", "disks")
	if err != nil {
		return "", err
	}
	pod := regexp.MustCompile(`node-debugger-` + regexp.QuoteMeta(node) + `-[a-z0-9]{5}\b`).FindString(out)
	if pod == "" {
		return "", fmt.Errorf("kubectl debug named no debug pod: %q", out)
	}
	defer s.c.Kubectl(context.WithoutCancel(ctx), "-n", k8s.AddonNamespace, "delete", "pod", pod, "--wait=false")
	if err := k8s.WaitFor(ctx, 3*time.Minute, "debug pod "+pod+" Succeeded", func() (bool, string, error) {
		phase, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "pod", pod, "-o", "jsonpath={.status.phase}")
		if phase == "Failed" {
			logs, _ := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "logs", pod)
			return false, phase, fmt.Errorf("debug pod %s failed: %s", pod, logs)
		}
		return err == nil && phase == "Succeeded", phase, nil
	}); err != nil {
		return "", err
	}
	list, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "logs", pod)
	if err != nil {
		return "", err
	}
	handles, err := s.c.Kubectl(ctx, "get", "volumeattachments", "-o",
		`jsonpath={range .items[?(@.spec.nodeName=="`+node+`")]}{.spec.source.persistentVolumeName}{"\n"}{end}`)
	if err != nil {
		return "", err
	}
	var named []string
	for _, pv := range strings.Fields(handles) {
		h, err := s.c.Kubectl(ctx, "get", "pv", pv, "-o", "jsonpath={.spec.csi.volumeHandle}")
		if err != nil {
			return "", err
		}
		if !strings.Contains(list, h) {
			return "", fmt.Errorf("`vco-agent disks` on %s does not name volume %s (PV %s), attached there:\n%s", node, h, pv, list)
		}
		named = append(named, h)
	}
	if len(named) == 0 {
		return "", fmt.Errorf("no volume is attached to %s to look for", node)
	}
	return fmt.Sprintf("the debug pod's `vco-agent disks` names %s (docs/diagnosis.md's image %s replaced by the lab's)", strings.Join(named, ", "), m[1]), nil
}
