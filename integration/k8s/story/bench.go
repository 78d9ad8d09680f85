package story

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// BenchMeasures are what a user sees of the fence, timed by Bench in
// each mode, in this order.
var BenchMeasures = []string{
	"claim to first pod Running",
	"pod moved with its claim (delete to Running on the other worker)",
	"drain (to Running on the other worker)",
	"partition failover (out-of-service taint to Running on the other worker)",
}

// BenchFigure is one measure's times in one mode, a time per round.
type BenchFigure struct {
	Measure string
	// Unfenced: the reference, every worker's agent with
	// volumes.fence_methods [none] and the unfenced opt-in.
	Unfenced bool
	Times    []time.Duration
}

// Mean is the figure's mean time.
func (f BenchFigure) Mean() time.Duration {
	var sum time.Duration
	for _, t := range f.Times {
		sum += t
	}
	return sum / time.Duration(max(1, len(f.Times)))
}

// Bench installs the add-on on c and times BenchMeasures rounds times in
// each of two modes side by side on the same cluster: fenced (the
// agents as shipped) and unfenced (the reference: each worker's agent
// claims no disk with a fence, volumes.fence_methods [none] with
// volumes.allow_unfenced, and the node plugin asks for the unfenced
// opt-in). The modes alternate, the order turned each round, so drift of
// the machine falls on both. The agents are left fenced.
func Bench(ctx context.Context, c *k8s.Cluster, rounds int, log io.Writer) ([]BenchFigure, error) {
	s := &story{c: cluster{c}, log: log, r: &e2e.Report{Started: time.Now(), Kind: string(c.Env.Backend.Kind)}}
	if s.r.Kind == "" {
		s.r.Kind = string(lab.SCSIBlock)
	}
	if _, err := c.InstallAddon(ctx); err != nil {
		return nil, err
	}
	if _, err := c.Kubectl(ctx, "create", "namespace", Namespace); err != nil {
		return nil, err
	}
	configs, err := s.agentConfigs(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.benchWarm(ctx); err != nil {
		return nil, err
	}
	figs := make([]BenchFigure, 0, 2*len(BenchMeasures))
	for _, unfenced := range []bool{true, false} {
		for _, m := range BenchMeasures {
			figs = append(figs, BenchFigure{Measure: m, Unfenced: unfenced})
		}
	}
	defer func() { _ = s.benchMode(context.WithoutCancel(ctx), configs, false) }()
	for r := range rounds {
		order := []bool{false, true}
		if r%2 == 1 {
			slices.Reverse(order)
		}
		for _, unfenced := range order {
			if err := s.benchMode(ctx, configs, unfenced); err != nil {
				return figs, err
			}
			times, err := s.benchRound(ctx, fmt.Sprintf("b%d-%s", r, modeName(unfenced)), unfenced)
			if err != nil {
				return figs, fmt.Errorf("round %d, %s: %w", r+1, modeName(unfenced), err)
			}
			for i, t := range times {
				j := i
				if !unfenced {
					j += len(BenchMeasures)
				}
				figs[j].Times = append(figs[j].Times, t)
			}
			fmt.Fprintf(log, "bench-k8s: round %d, %s: %v\n", r+1, modeName(unfenced), times)
		}
	}
	return figs, nil
}

func modeName(unfenced bool) string {
	if unfenced {
		return "unfenced"
	}
	return "fenced"
}

// agentConfigs are the workers' agent configuration files as they came.
func (s *story) agentConfigs(ctx context.Context) (map[string]string, error) {
	cfgs := map[string]string{}
	for _, g := range s.c.Env.Lab.Guests {
		out, err := g.MustSh(ctx, "cat /etc/vco-agent/config.yaml")
		if err != nil {
			return nil, err
		}
		if strings.Contains(out, "\nvolumes:") || strings.HasPrefix(out, "volumes:") {
			return nil, fmt.Errorf("%s's agent configuration has a volumes section already; the bench adds its own", g.Name)
		}
		cfgs[g.Name] = out
	}
	return cfgs, nil
}

// unfencedVolumes is the agent configuration's section of the reference.
const unfencedVolumes = "\nvolumes:\n  fence_methods: [none]\n  allow_unfenced: true\n"

// benchMode puts every worker's agent and the node plugin in a mode:
// the agents' configuration written and each agent restarted (nothing
// is staged between rounds), the node plugin's --allow-unfenced set or
// dropped and its pods rolled.
func (s *story) benchMode(ctx context.Context, configs map[string]string, unfenced bool) error {
	for _, g := range s.c.Env.Lab.Guests {
		cfg := configs[g.Name]
		if unfenced {
			cfg += unfencedVolumes
		}
		script := fmt.Sprintf("cat >/etc/vco-agent/config.yaml <<'EOF'\n%sEOF\nsystemctl restart vco-agent && systemctl is-active vco-agent", cfg)
		if _, err := g.MustSh(ctx, script); err != nil {
			return fmt.Errorf("%s: putting the agent %s: %w", g.Name, modeName(unfenced), err)
		}
	}
	out, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "daemonset", k8s.NodeName, "-o", "jsonpath={.spec.template.spec.containers[0].args}")
	if err != nil {
		return err
	}
	var args []string
	if err := json.Unmarshal([]byte(out), &args); err != nil {
		return fmt.Errorf("the node plugin's arguments %q: %w", out, err)
	}
	const opt = "--allow-unfenced"
	if slices.Contains(args, opt) == unfenced {
		return nil
	}
	if args = slices.DeleteFunc(args, func(a string) bool { return a == opt }); unfenced {
		args = append(args, opt)
	}
	patch, _ := json.Marshal([]map[string]any{{"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": args}})
	if _, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "patch", "daemonset", k8s.NodeName, "--type=json", "-p", string(patch)); err != nil {
		return err
	}
	_, err = s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "rollout", "status", "daemonset/"+k8s.NodeName, "--timeout=10m")
	return err
}

// benchRound times BenchMeasures once with a claim and writer named
// name: it is made, moved by a delete, drained back, and taken over from
// a partitioned node; then the writer and its claim go.
func (s *story) benchRound(ctx context.Context, name string, unfenced bool) ([]time.Duration, error) {
	began := time.Now()
	p, err := s.startWriter(ctx, name, pvc(name, "1Gi"))
	if err != nil {
		return nil, err
	}
	times := []time.Duration{time.Since(began)}
	pv, err := s.pvOf(ctx, name)
	if err != nil {
		return nil, err
	}
	for _, step := range []func(context.Context, string, podInfo, string, bool) (podInfo, time.Duration, error){
		s.benchMove, s.benchDrain, s.benchPartition,
	} {
		var took time.Duration
		if p, took, err = step(ctx, name, p, pv, unfenced); err != nil {
			return nil, err
		}
		times = append(times, took)
	}
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "deployment", name, "--wait=true"); err != nil {
		return nil, err
	}
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pvc", name, "--wait=true"); err != nil {
		return nil, err
	}
	return times, k8s.WaitFor(ctx, 5*time.Minute, "PV "+pv+" gone", func() (bool, string, error) {
		out, err := s.c.Kubectl(ctx, "get", "pv", "-o", "name")
		return err == nil && !slices.Contains(strings.Fields(out), "persistentvolume/"+pv), out, nil
	})
}

// readyOn waits for the writer name's one pod Ready on node.
func (s *story) readyOn(ctx context.Context, name, node string) (podInfo, error) {
	ps, err := s.waitPods(ctx, "app="+name, 10*time.Minute, name+" Ready on "+node, func(ps []podInfo) bool {
		return allReady(1)(ps) && ps[0].Node == node
	})
	if err != nil {
		return podInfo{}, err
	}
	return ps[0], nil
}

// benchMove cordons p's node and deletes p: the time to its successor
// Ready on the other worker.
func (s *story) benchMove(ctx context.Context, name string, p podInfo, _ string, _ bool) (podInfo, time.Duration, error) {
	to := s.other(p.Node)
	if _, err := s.c.Kubectl(ctx, "cordon", p.Node); err != nil {
		return p, 0, err
	}
	defer func() { _, _ = s.c.Kubectl(context.WithoutCancel(ctx), "uncordon", p.Node) }()
	began := time.Now()
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pod", p.Name, "--wait=false"); err != nil {
		return p, 0, err
	}
	moved, err := s.readyOn(ctx, name, to)
	return moved, time.Since(began), err
}

// benchDrain drains p's node: the time from the drain's start to the
// pod Ready on the other worker.
func (s *story) benchDrain(ctx context.Context, name string, p podInfo, _ string, _ bool) (podInfo, time.Duration, error) {
	to := s.other(p.Node)
	began := time.Now()
	if out, err := s.c.Kubectl(ctx, "drain", p.Node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=5m"); err != nil {
		return p, 0, fmt.Errorf("%w: %s", err, lab.LastLines(out, 3))
	}
	defer func() { _, _ = s.c.Kubectl(context.WithoutCancel(ctx), "uncordon", p.Node) }()
	moved, err := s.readyOn(ctx, name, to)
	return moved, time.Since(began), err
}

// benchPartition cuts p's node off the API server (K10's partition),
// taints it out-of-service once NotReady: the time from the taint to the
// pod Ready on the other worker. Then the node is healed (after its host
// watchdog's reset, which a fenced lease holder gets as in K10) and
// nothing of pv is left there.
func (s *story) benchPartition(ctx context.Context, name string, p podInfo, pv string, unfenced bool) (podInfo, time.Duration, error) {
	old, to := s.c.Env.Lab.Guest(p.Node), s.other(p.Node)
	healed := false
	defer s.undoPartition(ctx, old, &healed)
	if _, err := old.MustSh(ctx, cutScript()); err != nil {
		return p, 0, err
	}
	if err := k8s.WaitFor(ctx, 5*time.Minute, old.Name+" NotReady", func() (bool, string, error) {
		st, err := s.c.Kubectl(ctx, "get", "node", old.Name, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		return err == nil && strings.TrimSpace(st) != "True", st, nil
	}); err != nil {
		return p, 0, err
	}
	began := time.Now()
	if _, err := s.c.Kubectl(ctx, "taint", "node", old.Name, "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute"); err != nil {
		return p, 0, err
	}
	moved, err := s.readyOn(ctx, name, to)
	if err != nil {
		return p, 0, err
	}
	took := time.Since(began)
	if err := s.benchHeal(ctx, old, pv, s.r.Kind == string(lab.VirtioBlk) && !unfenced); err != nil {
		return moved, took, err
	}
	healed = true
	return moved, took, nil
}

// benchHeal waits for old's reset by its host watchdog when reset says
// it held a lease the takeover ended (a fenced lease holder whose disk
// the platform unplugged resets, as in K10), heals its partition and
// waits until nothing of pv is left on it.
func (s *story) benchHeal(ctx context.Context, old *lab.Guest, pv string, reset bool) error {
	out, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "pv", pv, "-o", "jsonpath={.spec.csi.volumeHandle}")
	if err != nil {
		return err
	}
	h := strings.TrimSpace(out)
	if reset {
		if err := k8s.WaitFor(ctx, 3*time.Minute, old.Name+" reset by its host watchdog", func() (bool, string, error) {
			return resetSeen(ctx, old) != "", "", nil
		}); err != nil {
			return err
		}
	}
	if resetSeen(ctx, old) != "" {
		if _, err := old.WaitBack(ctx, 5*time.Minute); err != nil {
			return err
		}
	}
	if _, err := old.MustSh(ctx, healScript()); err != nil {
		return err
	}
	if err := k8s.WaitFor(ctx, 5*time.Minute, "nothing of "+pv+" left on "+old.Name, func() (bool, string, error) {
		left, err := s.leftOn(ctx, old, pv, h)
		if err != nil {
			return false, err.Error(), nil
		}
		return left == "", left, nil
	}); err != nil {
		return err
	}
	_, err = s.c.Kubectl(ctx, "taint", "node", old.Name, "node.kubernetes.io/out-of-service-")
	return err
}

// benchWarm puts on every worker the images a measure would otherwise
// pull on its first run there, which would fall on whichever mode runs
// first: the writer's (a pod that exits at once, per worker) and the
// controller's (its pod moved to each worker in turn: a drain evicts it
// from the drained node, and it comes back on the other).
func (s *story) benchWarm(ctx context.Context) error {
	var nodes []string
	for _, g := range s.c.Env.Lab.Guests {
		nodes = append(nodes, g.Name)
	}
	for _, n := range nodes {
		name := "warm-" + n
		if err := s.apply(ctx, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s}
spec:
  nodeName: %s
  restartPolicy: Never
  containers:
    - {name: warm, image: %s, command: ["true"]}
`, name, n, WorkloadImage)); err != nil {
			return err
		}
		if err := k8s.WaitFor(ctx, 10*time.Minute, name+" Succeeded", func() (bool, string, error) {
			ph, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "pod", name, "-o", "jsonpath={.status.phase}")
			return err == nil && strings.TrimSpace(ph) == "Succeeded", ph, nil
		}); err != nil {
			return err
		}
		if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "pod", name, "--wait=true"); err != nil {
			return err
		}
	}
	for _, n := range nodes {
		if err := s.controllerOn(ctx, n, nodes); err != nil {
			return err
		}
	}
	return nil
}

// controllerOn moves the controller's pod to node (every other node
// cordoned meanwhile) and waits until it is available there.
func (s *story) controllerOn(ctx context.Context, node string, nodes []string) error {
	for _, n := range nodes {
		if n != node {
			if _, err := s.c.Kubectl(ctx, "cordon", n); err != nil {
				return err
			}
			defer func() { _, _ = s.c.Kubectl(context.WithoutCancel(ctx), "uncordon", n) }()
		}
	}
	const sel = "app.kubernetes.io/name=" + k8s.ControllerName
	at, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "pods", "-l", sel, "-o", "jsonpath={.items[*].spec.nodeName}")
	if err != nil {
		return err
	}
	if strings.TrimSpace(at) != node {
		if _, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "delete", "pods", "-l", sel, "--wait=true"); err != nil {
			return err
		}
	}
	return k8s.WaitFor(ctx, 10*time.Minute, "the controller Ready on "+node, func() (bool, string, error) {
		out, err := s.c.Kubectl(ctx, "-n", k8s.AddonNamespace, "get", "pods", "-l", sel, "-o",
			`jsonpath={range .items[*]}{.spec.nodeName}={.status.conditions[?(@.type=="Ready")].status} {end}`)
		return err == nil && strings.TrimSpace(out) == node+"=True", out, nil
	})
}
