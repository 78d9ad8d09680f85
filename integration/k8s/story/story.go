package story

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/k8s"
	"github.com/whitesky-cloud/vco-storage/integration/k8s/images"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// WorkloadImage is the image of the scenarios' pods (a shell and sleep).
const WorkloadImage = images.WorkloadRef

// Namespace holds the scenarios' objects.
const Namespace = "vco-lab"

// scenario is one scenario of the Kubernetes story and how it runs.
type scenario struct {
	e2e.Scenario
	// usesK4: it works on K4's claim and Deployment, so it runs after K4.
	usesK4 bool
	// alone: it runs only by itself, on a cluster of its own, and not
	// among the default scenarios (Scenarios).
	alone bool
	run   func(*story, context.Context) error
}

// storyScenarios are the scenarios Run knows, in the order they run
// (docs/development.md, "The Kubernetes lab", lists them from here).
var storyScenarios = []scenario{
	{Scenario: e2e.Scenario{ID: "K1", Name: "a claim and its pod: the PV's topology, and the node plugin refused the node's secrets", Props: []e2e.Property{e2e.P5}}, run: (*story).k1},
	{Scenario: e2e.Scenario{ID: "K2", Name: "two replicas share one RWO claim: the second is held with a Multi-Attach error", Props: []e2e.Property{e2e.P1}}, run: (*story).k2},
	{Scenario: e2e.Scenario{ID: "K3", Name: "a StatefulSet's PHYSICAL disks, each mounted on its own node only", Props: []e2e.Property{e2e.P1}}, run: (*story).k3},
	{Scenario: e2e.Scenario{ID: "K7", Name: "an encrypted claim with a Vault server: moved, rotated, rewrapped, refused", Props: []e2e.Property{e2e.P5}}, run: (*story).k7},
	{Scenario: e2e.Scenario{ID: "K10", Name: "a partitioned holder: the pod moves with its data and the old node's writes never land", Props: []e2e.Property{e2e.P1, e2e.P3}}, run: (*story).k10},
	{Scenario: e2e.Scenario{ID: "K11", Name: "a worker with staged volumes rebooted, reset, and stopped past the lease's fail bound", Props: []e2e.Property{e2e.P5}}, run: (*story).k11},
	{Scenario: e2e.Scenario{ID: "K12", Name: "the kubelet, the agent and the node plugin restarted under write load", Props: []e2e.Property{e2e.P5}}, run: (*story).k12},
	{Scenario: e2e.Scenario{ID: "K13", Name: "the controller restarted during 20 provisions and during a move", Props: []e2e.Property{e2e.P1, e2e.P5}}, run: (*story).k13},
	{Scenario: e2e.Scenario{ID: "K4", Name: "a drain moves the pod with its data", Props: []e2e.Property{e2e.P1, e2e.P5}}, run: (*story).k4},
	{Scenario: e2e.Scenario{ID: "K6", Name: "online expansion of K4's claim", Props: nil}, usesK4: true, run: (*story).k6},
	{Scenario: e2e.Scenario{ID: "K9", Name: "snapshots installed after the add-on: a restore of K4's claim holds its data", Props: []e2e.Property{e2e.P5}}, usesK4: true, run: (*story).k9},
	{Scenario: e2e.Scenario{ID: "K8", Name: "the platform attaches K4's disk to the other worker too: refused there", Props: []e2e.Property{e2e.P2}}, usesK4: true, run: (*story).k8},
	{Scenario: e2e.Scenario{ID: "K5", Name: "a powered-off node: K4's disk taken over, the node fenced", Props: []e2e.Property{e2e.P1, e2e.P3, e2e.P4, e2e.P5}}, usesK4: true, run: (*story).k5},
	{Scenario: e2e.Scenario{ID: "K14", Name: "the add-on delivered by a ClusterResourceSet: its size limit, Reconcile against a hand edit, an upgrade", Props: nil}, alone: true, run: (*story).k14},
}

// All are the Kubernetes story's scenarios, in the order they run.
var All = func() []e2e.Scenario {
	scs := make([]e2e.Scenario, len(storyScenarios))
	for i, sc := range storyScenarios {
		scs[i] = sc.Scenario
	}
	return scs
}()

// Scenarios are the ids of the scenarios a run takes by default (all
// but those that run alone), in order.
var Scenarios = func() []string {
	var ids []string
	for _, sc := range storyScenarios {
		if !sc.alone {
			ids = append(ids, sc.ID)
		}
	}
	return ids
}()

// Alone are the ids of the scenarios that run only by themselves: K14
// deletes the add-on the setup applied and delivers it again, so nothing
// else may hold a volume of the driver meanwhile (make soak-k8s-crs).
var Alone = func() []string {
	var ids []string
	for _, sc := range storyScenarios {
		if sc.alone {
			ids = append(ids, sc.ID)
		}
	}
	return ids
}()

// Brief are the scenarios of `make test` (docs/development.md, "Time per
// tier"); `make k8s-lab` and `make soak` run them all.
var Brief = []string{"K1", "K2", "K12", "K4"}

// cluster is the lab's cluster with what the scenarios add to it.
type cluster struct{ *k8s.Cluster }

type story struct {
	c   cluster
	r   *e2e.Report
	log io.Writer
}

// Run installs the add-on and runs the scenarios on the cluster,
// recording each step and each piece of evidence for P1-P5.
func Run(ctx context.Context, c *k8s.Cluster, scenarios []string, log io.Writer) *e2e.Report {
	s := &story{c: cluster{c}, log: log, r: &e2e.Report{Started: time.Now(), Kind: string(c.Env.Backend.Kind),
		Setup: c.SetupTime, Boot: map[string]time.Duration{}}}
	if s.r.Kind == "" {
		s.r.Kind = string(lab.SCSIBlock)
	}
	for _, g := range c.Env.Lab.Guests {
		s.r.Boot[g.Name] = g.BootTime
	}
	defer func() { s.r.Finished = time.Now() }()
	for _, p := range e2e.Properties {
		if !slices.Contains(Exercised(scenarios), p) {
			s.r.NotRun = append(s.r.NotRun, fmt.Sprintf("%s in Kubernetes: none of the scenarios run (%s) exercises it; the full story (make k8s-lab) and the lab story (make lab) do", p, strings.Join(scenarios, ",")))
		}
	}
	if err := checkAlone(scenarios); err != nil {
		s.r.Err = err
		return s.r
	}
	if err := s.step("setup", "cluster", "apply the add-on as seed 001 says (Secret, make csi-addon | kubectl apply -f -)", func() (string, error) {
		return c.InstallAddon(ctx)
	}); err != nil {
		s.r.Err = err
		return s.r
	}
	if _, err := c.Kubectl(ctx, "create", "namespace", Namespace); err != nil {
		s.r.Err = err
		return s.r
	}
	todo, err := chosen(scenarios)
	if err != nil {
		s.r.Err = err
		return s.r
	}
	for _, sc := range todo {
		s.r.Scenarios = append(s.r.Scenarios, sc.Scenario)
		if err := sc.run(s, ctx); err != nil {
			s.r.Err = fmt.Errorf("%s: %w", sc.ID, err)
			return s.r
		}
	}
	return s.r
}

// chosen are the scenarios ids name, in the order given, refusing an
// unknown id and one that uses K4's claim without K4 before it.
func chosen(ids []string) ([]scenario, error) {
	var out []scenario
	for i, id := range ids {
		j := slices.IndexFunc(storyScenarios, func(sc scenario) bool { return sc.ID == id })
		if j < 0 {
			_, err := e2e.Lookup(All, id)
			return nil, err
		}
		sc := storyScenarios[j]
		if sc.usesK4 && !slices.Contains(ids[:i], "K4") {
			return nil, fmt.Errorf("scenario %s uses K4's claim: run K4 before it", id)
		}
		out = append(out, sc)
	}
	return out, nil
}

func (s *story) step(scenario, node, name string, f func() (string, error)) error {
	st, err := s.r.Run(scenario, node, name, f)
	mark := "ok  "
	if err != nil {
		mark = "FAIL"
	}
	fmt.Fprintf(s.log, "%s %-6s %-9s %s (%.1fs)\n", mark, scenario, node, name, st.Duration.Seconds())
	return err
}

func (s *story) check(p e2e.Property, scenario string, held bool, format string, a ...any) {
	s.r.Check(p, scenario, held, format, a...)
}

func (s *story) apply(ctx context.Context, yaml string) error {
	_, err := s.c.KubectlInput(ctx, strings.NewReader(yaml), "-n", Namespace, "apply", "-f", "-")
	return err
}

// statefulSet is a StatefulSet name of replicas writers (writerSpec with
// the pod spec's extra lines placement), started in parallel, each with a
// 1 GiB claim "data" of class (the default class when "").
func statefulSet(name string, replicas int, class, placement string) string {
	sc := ""
	if class != "" {
		sc = "        storageClassName: " + class + "\n"
	}
	return fmt.Sprintf(`apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: %[1]s
spec:
  serviceName: %[1]s
  replicas: %[2]d
  podManagementPolicy: Parallel
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
%[3]s  volumeClaimTemplates:
    - metadata: {name: data}
      spec:
%[4]s        accessModes: [ReadWriteOnce]
        resources: {requests: {storage: 1Gi}}
`, name, replicas, writerSpec("", placement, "      "), sc)
}

// pvc is a claim of the default class (no storageClassName).
func pvc(name, size string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: %s
spec:
  accessModes: [ReadWriteOnce]
  resources:
    requests:
      storage: %s
`, name, size)
}

// startWriter applies claim and its writer (applyWriter) and waits until
// the writer's pod is Ready.
func (s *story) startWriter(ctx context.Context, name, claim string) (podInfo, error) {
	if err := s.applyWriter(ctx, name, claim); err != nil {
		return podInfo{}, err
	}
	ps, err := s.waitPods(ctx, "app="+name, 10*time.Minute, name+" Ready", allReady(1))
	if err != nil {
		return podInfo{}, err
	}
	return ps[0], nil
}

// applyWriter applies claim (a claim's YAML) and a Deployment of the
// same name of one writer pod on it (writerSpec), replaced by Recreate.
func (s *story) applyWriter(ctx context.Context, name, claim string) error {
	return s.apply(ctx, claim+"---\n"+fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata:
  name: %[1]s
spec:
  replicas: 1
  strategy: {type: Recreate}
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
%[2]s`, name, writerSpec(name, "", "      ")))
}

// writerSpec is a pod spec, indented by indent: a container that appends
// a line naming its node to /data/log, syncs, and sleeps; extra is more
// of the spec (unindented). With claim empty the spec has no volumes (a
// StatefulSet's template gets them from its volumeClaimTemplates).
func writerSpec(claim, extra, indent string) string {
	spec := fmt.Sprintf(`terminationGracePeriodSeconds: 2
%scontainers:
  - name: writer
    image: %s
    command: ["sh", "-c", "echo written-on-$NODE >>/data/log && sync && exec sleep 1000000"]
    env:
      - name: NODE
        valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
    volumeMounts:
      - {name: data, mountPath: /data}
`, extra, WorkloadImage)
	if claim != "" {
		spec += fmt.Sprintf(`volumes:
  - name: data
    persistentVolumeClaim: {claimName: %s}
`, claim)
	}
	lines := strings.SplitAfter(spec, "\n")
	var b strings.Builder
	for _, l := range lines {
		if l != "" {
			b.WriteString(indent + l)
		}
	}
	return b.String()
}

type podInfo struct {
	Name, Node, Phase, UID string
	Ready                  bool
	// Started is when its latest running container started (zero when
	// none runs).
	Started time.Time
}

func (s *story) pods(ctx context.Context, selector string) ([]podInfo, error) {
	out, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "pods", "-l", selector, "-o", "json")
	if err != nil {
		return nil, err
	}
	var list struct {
		Items []struct {
			Metadata struct {
				Name              string
				UID               string
				DeletionTimestamp *string
			}
			Spec   struct{ NodeName string }
			Status struct {
				Phase             string
				Conditions        []struct{ Type, Status string }
				ContainerStatuses []struct {
					State struct {
						Running *struct{ StartedAt time.Time }
					}
				}
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		return nil, err
	}
	var ps []podInfo
	for _, it := range list.Items {
		if it.Metadata.DeletionTimestamp != nil {
			continue
		}
		p := podInfo{Name: it.Metadata.Name, Node: it.Spec.NodeName, Phase: it.Status.Phase, UID: it.Metadata.UID}
		for _, c := range it.Status.Conditions {
			if c.Type == "Ready" && c.Status == "True" {
				p.Ready = true
			}
		}
		for _, c := range it.Status.ContainerStatuses {
			if r := c.State.Running; r != nil && r.StartedAt.After(p.Started) {
				p.Started = r.StartedAt
			}
		}
		ps = append(ps, p)
	}
	return ps, nil
}

// waitPods waits until the selector's pods number n and want(pods) holds.
func (s *story) waitPods(ctx context.Context, selector string, limit time.Duration, what string, want func([]podInfo) bool) ([]podInfo, error) {
	var ps []podInfo
	err := k8s.WaitFor(ctx, limit, what, func() (bool, string, error) {
		var err error
		ps, err = s.pods(ctx, selector)
		if err != nil {
			return false, err.Error(), nil
		}
		return want(ps), fmt.Sprintf("%+v", ps), nil
	})
	if err != nil {
		ev, _ := s.c.Kubectl(ctx, "-n", Namespace, "get", "events", "--sort-by=.lastTimestamp")
		return ps, fmt.Errorf("%w\nevents:\n%s", err, lab.LastLines(ev, 20))
	}
	return ps, nil
}

func allReady(n int) func([]podInfo) bool {
	return func(ps []podInfo) bool {
		if len(ps) != n {
			return false
		}
		for _, p := range ps {
			if !p.Ready {
				return false
			}
		}
		return true
	}
}

// pvOf returns the name of the PV bound to claim.
func (s *story) pvOf(ctx context.Context, claim string) (string, error) {
	out, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "pvc", claim, "-o", "jsonpath={.spec.volumeName}")
	out = strings.TrimSpace(out)
	if err == nil && out == "" {
		err = fmt.Errorf("claim %s is not bound", claim)
	}
	return out, err
}

// volumeMount is where the kubelet mounted pv for pod uid on g.
func volumeMount(uid, pv string) string {
	return fmt.Sprintf("/var/lib/kubelet/pods/%s/volumes/kubernetes.io~csi/%s/mount", uid, pv)
}

// readLog reads /data/log of pod p through its node (the API server does
// not reach the workers' kubelets, so kubectl exec is not used).
func (s *story) readLog(ctx context.Context, p podInfo, pv string) (string, error) {
	g := s.c.Env.Lab.Guest(p.Node)
	if g == nil {
		return "", fmt.Errorf("pod %s is on %q, not a lab worker", p.Name, p.Node)
	}
	out, err := g.MustSh(ctx, "cat "+volumeMount(p.UID, pv)+"/log")
	return strings.TrimSpace(out), err
}

// mountsOf lists the lines of g's /proc/mounts that are pv's: its publish
// paths (which name the PV) and its staging path (named by the SHA-256 of
// its volume handle, kubernetes.io/csi/<driver>/<hash>/globalmount).
func (s *story) mountsOf(ctx context.Context, g *lab.Guest, pv string) ([]string, error) {
	handle, err := s.c.Kubectl(ctx, "get", "pv", pv, "-o", "jsonpath={.spec.csi.volumeHandle}")
	if err != nil {
		return nil, err
	}
	if strings.TrimSpace(handle) == "" {
		return nil, fmt.Errorf("PV %s has no CSI volume handle", pv)
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(handle)))
	out, err := g.MustSh(ctx, fmt.Sprintf("grep -F -e %s -e %x /proc/mounts || true", pv, sum))
	if err != nil {
		return nil, err
	}
	var l []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line != "" {
			l = append(l, line)
		}
	}
	return l, nil
}

func (s *story) other(node string) string {
	for _, g := range s.c.Env.Lab.Guests {
		if g.Name != node {
			return g.Name
		}
	}
	return ""
}

// k1: a claim of the default class and a pod. The PV carries a
// nodeAffinity on the topology key equal to the pod's node's label;
// CSINode shows the driver under the class's provisioner name; nodes carry
// the topology label.
func (s *story) k1(ctx context.Context) error {
	const sc = "K1"
	var p podInfo
	if err := s.step(sc, "cluster", "PVC of the default class and a pod writing to it", func() (string, error) {
		if err := s.apply(ctx, pvc("k1", "1Gi")+"---\n"+fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: k1
  labels: {app: k1}
spec:
%s`, writerSpec("k1", "", "  "))); err != nil {
			return "", err
		}
		ps, err := s.waitPods(ctx, "app=k1", 10*time.Minute, "pod k1 Ready", allReady(1))
		if err != nil {
			return "", err
		}
		p = ps[0]
		return "pod k1 Ready on " + p.Node, nil
	}); err != nil {
		return err
	}
	if err := s.step(sc, "cluster", "PV nodeAffinity, CSINode and node labels (the seed's checks)", func() (string, error) {
		pv, err := s.pvOf(ctx, "k1")
		if err != nil {
			return "", err
		}
		aff, err := s.c.Kubectl(ctx, "get", "pv", pv, "-o", "jsonpath={range .spec.nodeAffinity.required.nodeSelectorTerms[*].matchExpressions[*]}{.key}={.values[*]}{\"\\n\"}{end}")
		if err != nil {
			return "", err
		}
		label, err := s.c.Kubectl(ctx, "get", "node", p.Node, "-o", "jsonpath={.metadata.labels.cloud\\.whitesky/location}")
		if err != nil {
			return "", err
		}
		want := "cloud.whitesky/location=" + label
		if label == "" || !strings.Contains(aff, want) {
			return "", fmt.Errorf("PV %s nodeAffinity %q does not require %q (node %s's label)", pv, strings.TrimSpace(aff), want, p.Node)
		}
		prov, err := s.c.Kubectl(ctx, "get", "storageclass", "vco-csi", "-o", "jsonpath={.provisioner}")
		if err != nil {
			return "", err
		}
		drivers, err := s.c.Kubectl(ctx, "get", "csinode", p.Node, "-o", "jsonpath={.spec.drivers[*].name}")
		if err != nil {
			return "", err
		}
		if !strings.Contains(" "+drivers+" ", " "+prov+" ") {
			return "", fmt.Errorf("CSINode %s lists %q, not the class's provisioner %q", p.Node, drivers, prov)
		}
		data, err := s.readLog(ctx, p, pv)
		if err != nil {
			return "", err
		}
		held := data == "written-on-"+p.Node
		s.check(e2e.P5, sc, held, "K1: a new volume was formatted once and holds what the pod wrote (%q)", data)
		if !held {
			return "", fmt.Errorf("the pod's volume holds %q", data)
		}
		return fmt.Sprintf("PV %s requires %s; CSINode %s lists %s; node label %s", pv, want, p.Node, prov, label), nil
	}); err != nil {
		return err
	}
	if err := s.step(sc, p.Node, "the node plugin's container reads no other pod's Secret or token and no kubelet key (docs/security.md)", func() (string, error) {
		return s.k1NodeView(ctx, p.Node)
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "the node's view without SSH (docs/diagnosis.md)", func() (string, error) {
		return s.diagnose(ctx, p.Node)
	})
}

// k2: the seed's failure: two replicas of a Deployment share one RWO
// claim and are forced onto two workers. The second is held with the
// Multi-Attach error and never mounts; the first keeps its data.
func (s *story) k2(ctx context.Context) error {
	const sc = "K2"
	var first, second podInfo
	var pv string
	aff := `affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - labelSelector: {matchLabels: {app: k2}}
        topologyKey: kubernetes.io/hostname
`
	if err := s.step(sc, "cluster", "Deployment of 2 replicas sharing one RWO claim, one per worker", func() (string, error) {
		return s.k2Deploy(ctx, aff, &first, &second, &pv)
	}); err != nil {
		return err
	}
	return s.step(sc, "cluster", "the second pod is held with Multi-Attach error; no second mount; the first keeps its data", func() (string, error) {
		return s.k2Held(ctx, sc, first, second, pv)
	})
}

// k2Deploy deploys two replicas sharing one claim on two workers (anti-affinity aff) and sets first to the one Ready, second to the other and pv to the claim's volume.
func (s *story) k2Deploy(ctx context.Context, aff string, first, second *podInfo, pv *string) (string, error) {
	if err := s.apply(ctx, pvc("k2", "1Gi")+"---\n"+fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata:
  name: k2
spec:
  replicas: 2
  selector: {matchLabels: {app: k2}}
  template:
    metadata: {labels: {app: k2}}
    spec:
%s`, writerSpec("k2", aff, "      "))); err != nil {
		return "", err
	}
	ps, err := s.waitPods(ctx, "app=k2", 10*time.Minute, "one k2 pod Ready, the other scheduled", func(ps []podInfo) bool {
		ready, sched := 0, 0
		for _, p := range ps {
			if p.Ready {
				ready++
			}
			if p.Node != "" {
				sched++
			}
		}
		return len(ps) == 2 && ready == 1 && sched == 2
	})
	if err != nil {
		return "", err
	}
	for _, p := range ps {
		if p.Ready {
			*first = p
		} else {
			*second = p
		}
	}
	if *pv, err = s.pvOf(ctx, "k2"); err != nil {
		return "", err
	}
	return fmt.Sprintf("%s Ready on %s; %s scheduled on %s", first.Name, first.Node, second.Name, second.Node), nil
}

// k2Held checks that second is held with the Multi-Attach error and never mounts pv, and that first keeps its data.
func (s *story) k2Held(ctx context.Context, sc string, first, second podInfo, pv string) (string, error) {
	var msg string
	if err := k8s.WaitFor(ctx, 3*time.Minute, "a Multi-Attach error event for "+second.Name, func() (bool, string, error) {
		out, err := s.c.Kubectl(ctx, "-n", Namespace, "get", "events", "--field-selector", "involvedObject.name="+second.Name,
			"-o", "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}")
		if err != nil {
			return false, err.Error(), nil
		}
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, "Multi-Attach error for volume") {
				msg = l
				return true, out, nil
			}
		}
		return false, out, nil
	}); err != nil {
		return "", err
	}
	// Held, not merely slow: it stays not ready for a while.
	time.Sleep(20 * time.Second)
	ps, err := s.pods(ctx, "app=k2")
	if err != nil {
		return "", err
	}
	for _, p := range ps {
		if p.Name == second.Name && (p.Ready || p.Phase == "Running") {
			return "", fmt.Errorf("the second pod %s became %s on %s", p.Name, p.Phase, p.Node)
		}
	}
	secondMounts, err := s.mountsOf(ctx, s.c.Env.Lab.Guest(second.Node), pv)
	if err != nil {
		return "", err
	}
	s.check(e2e.P1, sc, len(secondMounts) == 0, "K2: %s on %s held (%s); mounts of %s there: %d", second.Name, second.Node, msg, pv, len(secondMounts))
	if len(secondMounts) > 0 {
		return "", fmt.Errorf("%s has %s mounted: %v", second.Node, pv, secondMounts)
	}
	data, err := s.readLog(ctx, first, pv)
	if err != nil {
		return "", err
	}
	if data != "written-on-"+first.Node {
		return "", fmt.Errorf("the first pod's volume holds %q", data)
	}
	// Leave the claim to K4's own Deployment: scale to none.
	if _, err := s.c.Kubectl(ctx, "-n", Namespace, "delete", "deployment", "k2", "--wait=true"); err != nil {
		return "", err
	}
	return fmt.Sprintf("event %q; %s never mounted on %s; %s's data intact", msg, pv, second.Node, first.Name), nil
}

// k4: kubectl drain of the pod's node: the pod comes back on the other
// worker with its data, the VolumeAttachment moved.
func (s *story) k4(ctx context.Context) error {
	const sc = "K4"
	var before podInfo
	var pv string
	if err := s.step(sc, "cluster", "a Deployment of one replica with its claim", func() (string, error) {
		p, err := s.startWriter(ctx, "k4", pvc("k4", "1Gi"))
		if err != nil {
			return "", err
		}
		before = p
		pv, err = s.pvOf(ctx, "k4")
		return "Ready on " + before.Node, err
	}); err != nil {
		return err
	}
	to := s.other(before.Node)
	if err := s.step(sc, before.Node, "kubectl drain", func() (string, error) {
		out, err := s.c.Kubectl(ctx, "drain", before.Node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=5m")
		return lab.LastLines(out, 3), err
	}); err != nil {
		return err
	}
	defer func() { _, _ = s.c.Kubectl(context.WithoutCancel(ctx), "uncordon", before.Node) }()
	return s.step(sc, to, "the pod back on the other worker with its data", func() (string, error) {
		ps, err := s.waitPods(ctx, "app=k4", 10*time.Minute, "k4 Ready on "+to, func(ps []podInfo) bool {
			return allReady(1)(ps) && ps[0].Node == to
		})
		if err != nil {
			return "", err
		}
		after := ps[0]
		data, err := s.readLog(ctx, after, pv)
		if err != nil {
			return "", err
		}
		want := "written-on-" + before.Node + "\nwritten-on-" + to
		s.check(e2e.P5, sc, data == want, "K4: after the drain the volume holds %q", data)
		if data != want {
			return "", fmt.Errorf("the volume holds %q, want %q", data, want)
		}
		va, err := s.c.Kubectl(ctx, "get", "volumeattachment", "-o",
			"jsonpath={range .items[?(@.spec.source.persistentVolumeName==\""+pv+"\")]}{.spec.nodeName}={.status.attached}{\" \"}{end}")
		if err != nil {
			return "", err
		}
		if strings.TrimSpace(va) != to+"=true" {
			return "", fmt.Errorf("VolumeAttachments of %s: %q, want only %s=true", pv, va, to)
		}
		old, err := s.mountsOf(ctx, s.c.Env.Lab.Guest(before.Node), pv)
		if err != nil {
			return "", err
		}
		s.check(e2e.P1, sc, len(old) == 0, "K4: %s left %s (mounts there: %d) before %s used it", pv, before.Node, len(old), to)
		return fmt.Sprintf("%s Ready on %s with %q; VolumeAttachment %s", after.Name, to, data, va), nil
	})
}

// WriteReport writes r as dir/k8s-report-KIND.txt and .html.
func WriteReport(r *e2e.Report, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	base := filepath.Join(dir, "k8s-report-"+r.Kind)
	var txt strings.Builder
	r.WriteText(&txt)
	if err := os.WriteFile(base+".txt", []byte(txt.String()), 0o644); err != nil {
		return err
	}
	f, err := os.Create(base + ".html")
	if err != nil {
		return err
	}
	if err := r.WriteHTML(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// checkAlone refuses a list that has a scenario of Alone with others.
func checkAlone(scenarios []string) error {
	for _, sc := range Alone {
		if slices.Contains(scenarios, sc) && len(scenarios) > 1 {
			return fmt.Errorf("scenario %s runs alone (it deletes the add-on and delivers it again): run -scenarios %s by itself (make soak-k8s-crs)", sc, sc)
		}
	}
	return nil
}

// Exercised are the safety properties scenarios give evidence for.
func Exercised(scenarios []string) []e2e.Property { return e2e.Exercised(All, scenarios) }

// Judge returns nil when the story ran to its end, no check failed and
// each property that the scenarios it ran exercise was checked.
func Judge(r *e2e.Report) error {
	if r.Err != nil {
		return r.Err
	}
	for _, c := range r.Checks {
		if !c.Held {
			return fmt.Errorf("%s did not hold in %s: %s", c.Property, c.Scenario, c.Evidence)
		}
	}
	var ran []string
	for _, st := range r.Steps {
		if !slices.Contains(ran, st.Scenario) {
			ran = append(ran, st.Scenario)
		}
	}
	for _, p := range Exercised(ran) {
		if _, checks := r.Verdict(p); len(checks) == 0 {
			return fmt.Errorf("%s was never checked", p)
		}
	}
	return nil
}
