package story

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// The node's own parts, restarted as an operator or a package upgrade
// would, and their metrics read on the node (the API server does not
// reach the workers' pods, so the node plugin's /metrics is read from its
// node).

// restartKubelet restarts node's kubelet and waits for its /healthz.
func (s *story) restartKubelet(ctx context.Context, node *lab.Guest) (string, error) {
	if _, err := node.MustSh(ctx, "systemctl restart kubelet"); err != nil {
		return "", err
	}
	err := k8s.WaitFor(ctx, 3*time.Minute, "the kubelet on "+node.Name+" healthy", func() (bool, string, error) {
		out, err := httpGet(ctx, node, "127.0.0.1", 10248, "/healthz")
		return err == nil && strings.HasSuffix(strings.TrimSpace(out), "ok"), lab.LastLines(out, 1), nil
	})
	return "the kubelet restarted", err
}

// restartAgent restarts node's vco-agent and waits until it answers.
func (s *story) restartAgent(ctx context.Context, node *lab.Guest) (string, error) {
	if _, err := node.MustSh(ctx, "systemctl restart vco-agent"); err != nil {
		return "", err
	}
	err := k8s.WaitFor(ctx, 3*time.Minute, "vco-agent on "+node.Name+" answering", func() (bool, string, error) {
		r, err := node.Sh(ctx, "vco-agent status")
		if err != nil {
			return false, err.Error(), nil
		}
		return r.Exit == 0, lab.LastLines(r.Stdout+r.Stderr, 2), nil
	})
	return "vco-agent restarted", err
}

// restartNodePlugin deletes the node plugin's pod on node and waits for
// its DaemonSet's next pod there to be Ready.
func (s *story) restartNodePlugin(ctx context.Context, node *lab.Guest) (string, error) {
	old, _, err := s.nodePlugin(ctx, node)
	if err != nil {
		return "", err
	}
	if _, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "delete", "pod", old, "--wait=false"); err != nil {
		return "", err
	}
	var now string
	err = k8s.WaitFor(ctx, 5*time.Minute, "a new node plugin Ready on "+node.Name, func() (bool, string, error) {
		name, ready, err := s.nodePlugin(ctx, node)
		if err != nil {
			return false, err.Error(), nil
		}
		now = name
		return name != old && ready, name, nil
	})
	return fmt.Sprintf("node plugin pod %s deleted, %s took its place", old, now), err
}

// nodePlugin is the node plugin's pod on node (not one being deleted) and
// whether it is Ready.
func (s *story) nodePlugin(ctx context.Context, node *lab.Guest) (string, bool, error) {
	out, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "pods", "-l", "app.kubernetes.io/name=vco-csi-node",
		"--field-selector", "spec.nodeName="+node.Name, "-o",
		`jsonpath={range .items[*]}{.metadata.name}|{.metadata.deletionTimestamp}|{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}`)
	if err != nil {
		return "", false, err
	}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if f := strings.Split(l, "|"); len(f) == 3 && f[0] != "" && f[1] == "" {
			return f[0], f[2] == "True", nil
		}
	}
	return "", false, fmt.Errorf("no node plugin pod on %s", node.Name)
}

// nodeMetrics reads the node plugin's /metrics on node: its own series
// and the agent's, which it re-exports.
func (s *story) nodeMetrics(ctx context.Context, node *lab.Guest) (map[string]float64, error) {
	name, _, err := s.nodePlugin(ctx, node)
	if err != nil {
		return nil, err
	}
	ip, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "pod", name, "-o", "jsonpath={.status.podIP}")
	if err != nil {
		return nil, err
	}
	out, err := httpGet(ctx, node, strings.TrimSpace(ip), 9812, "/metrics")
	if err != nil {
		return nil, err
	}
	return parseMetrics(out), nil
}

// parseMetrics reads the Prometheus text format's samples: series (with
// its labels as printed) to value.
func parseMetrics(text string) map[string]float64 {
	m := map[string]float64{}
	for _, l := range strings.Split(text, "\n") {
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		i := strings.LastIndexByte(l, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(l[i+1:], 64); err == nil {
			m[l[:i]] = v
		}
	}
	return m
}

// nodeStages is how many NodeStageVolume calls node's plugin answered OK.
func (s *story) nodeStages(ctx context.Context, node *lab.Guest) (float64, error) {
	m, err := s.nodeMetrics(ctx, node)
	if err != nil {
		return 0, err
	}
	return m[`vco_csi_operations_total{code="OK",method="NodeStageVolume"}`], nil
}

// nodeErrors lists the error counts of node's plugin and agent that grew
// since base (a scrape of nodeMetrics; nil: since they started): CSI calls
// not answered OK, agent operations not ok, claims fenced, refused or
// checked other than ok, agent scrapes that failed.
func (s *story) nodeErrors(ctx context.Context, node *lab.Guest, base map[string]float64) (string, error) {
	m, err := s.nodeMetrics(ctx, node)
	if err != nil {
		return "", err
	}
	return metricErrors(m, base), nil
}

// metricErrors is nodeErrors' judgement of a node plugin's series m
// against base. A counter below its base was reset (its process
// restarted): all it counts is new. Probe is left out: it asks whether
// the agent answers, which it cannot while it restarts, and a liveness
// probe failing then says so truly; no volume's call is counted there.
func metricErrors(m, base map[string]float64) string {
	var bad []string
	for series, v := range m {
		if b := base[series]; v >= b {
			v -= b
		}
		if v == 0 {
			continue
		}
		name, labels, _ := strings.Cut(series, "{")
		switch {
		case name == "vco_csi_operations_total" && !strings.Contains(labels, `code="OK"`) && !strings.Contains(labels, `method="Probe"`),
			name == "vco_agent_volume_operations_total" && !strings.Contains(labels, `result="ok"`),
			name == "vco_agent_claim_checks_total" && !strings.Contains(labels, `result="ok"`),
			name == "vco_agent_fences_total", name == "vco_agent_refusals_total",
			name == "vco_csi_agent_metrics_errors_total":
			bad = append(bad, fmt.Sprintf("%s %g", series, v))
		}
	}
	return strings.Join(bad, "; ")
}

// httpGet fetches http://host:port/path from node with bash's /dev/tcp
// (the workers have no HTTP client), and returns the body.
func httpGet(ctx context.Context, node *lab.Guest, host string, port int, path string) (string, error) {
	out, err := node.MustSh(ctx, fmt.Sprintf(`timeout 20 bash -c 'exec 3<>/dev/tcp/%s/%d && printf "GET %s HTTP/1.0\r\nHost: %s\r\n\r\n" >&3 && cat <&3'`, host, port, path, host))
	if err != nil {
		return "", err
	}
	head, body, ok := strings.Cut(out, "\r\n\r\n")
	if !ok || !strings.Contains(strings.SplitN(head, "\r\n", 2)[0], " 200 ") {
		return "", fmt.Errorf("GET %s:%d%s on %s: %q", host, port, path, node.Name, lab.LastLines(head, 3))
	}
	return body, nil
}
