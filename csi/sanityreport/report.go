// Package sanityreport judges a csi-sanity run from its Ginkgo JSON
// report: every spec passes, and a spec may be skipped only for a
// capability vco-csi does not advertise. Both the in-process suite and the
// csi-sanity binary tier apply the same rule, so the list of acceptable
// skips lives once, here; the README lists the same with the reasons.
package sanityreport

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/onsi/ginkgo/v2/types"
)

// NotAdvertised maps csi-sanity's skip messages that name a capability
// vco-csi does not advertise to why it does not.
var NotAdvertised = map[string]string{
	"ControllerGetVolumeHealth not supported":                   "volume health is reported by the node, where the fence is",
	"ControllerListVolumeHealth not supported":                  "volume health is reported by the node, where the fence is",
	"ControllerModifyVolume not supported":                      "no volume attribute classes: a disk's type and IOPS are fixed at creation",
	"Modify Volume not supported":                               "no volume attribute classes: a disk's type and IOPS are fixed at creation",
	"Modify volume not supported":                               "no volume attribute classes: a disk's type and IOPS are fixed at creation",
	"GroupControllerService not supported":                      "the cloud API has no consistent group snapshots",
	"NodeGetStorageHealth not supported":                        "no node-wide storage health: the agent reports per volume (NodeGetVolumeHealth)",
	"SNAPSHOT_ACCESSIBILITY_CONSTRAINTS not supported":          "a snapshot lives in its disk's location; no separate constraints",
	"ControllerPublishVolume.readonly field not supported":      "read-only is applied by the node (mount and BLKROSET), not by attaching",
	"Service does not have single node multi writer capability": "SINGLE_NODE_MULTI_WRITER is not offered: a volume has one writer, or readers only",
}

// Check reads a Ginkgo JSON report and returns how many specs passed and
// one line per spec that broke the rule. known maps the full text of specs
// a run skips on purpose, for a defect outside the plugin, to that defect;
// they are accepted only when skipped.
func Check(file string, known map[string]string) (passed int, problems []string, err error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, nil, err
	}
	var reports []types.Report
	if err := json.Unmarshal(b, &reports); err != nil {
		return 0, nil, fmt.Errorf("csi-sanity report %s: %w", file, err)
	}
	for _, r := range reports {
		for _, sp := range r.SpecReports {
			if sp.LeafNodeType != types.NodeTypeIt {
				continue
			}
			switch sp.State {
			case types.SpecStatePassed:
				passed++
			case types.SpecStateSkipped:
				if _, ok := known[sp.FullText()]; ok {
					continue
				}
				if _, ok := NotAdvertised[sp.Failure.Message]; !ok {
					problems = append(problems, fmt.Sprintf("spec %q skipped for a reason that is not an unadvertised capability: %q", sp.FullText(), sp.Failure.Message))
				}
			case types.SpecStatePending:
				// Marked pending in csi-test itself; it never runs.
			default:
				problems = append(problems, fmt.Sprintf("spec %q: %s: %s", sp.FullText(), sp.State, sp.Failure.Message))
			}
		}
	}
	sort.Strings(problems)
	return passed, problems, nil
}
