// Package e2e drives the multi-node ReadWriteOnce story end to end, the way
// a Kubernetes cluster would: controller calls from the host against the
// vco-csi controller talking to the whitesky.cloud simulator in lab mode,
// node calls to the vco-csi node plugin in each QEMU guest (through the
// exec channel, as the kubelet on that node), platform misbehaviour
// through the simulator's faults, and checks of the disk's backing file on
// the host. It turns what happened into a Report with a verdict per safety
// property (docs/architecture.md, Safety properties); `vco-lab run` (make lab) and the guest-tier
// tests both run it.
package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// Options configure a run.
type Options struct {
	Env *simlab.Env
	// Progress receives a line per step as it finishes (may be nil).
	Progress io.Writer
	// Skip names scenarios to leave out, of Optional (the others are
	// the story's spine and always run).
	Skip map[string]bool
	// SkipWhy says, for the report, why a skipped scenario was left out
	// (default: by request); it reads after "left out", e.g. "because ...".
	SkipWhy map[string]string
	// Only, if set, runs just the setup and that one self-contained
	// scenario (E6, E7 or E9), on a volume of its own.
	Only string
	// TransitPort is the port on 127.0.0.1 of the transit engine E6 wraps
	// passphrases with, and TransitToken a token it accepts. E6 runs only
	// when it is set; `vco-lab run` sets it to a fake engine it starts,
	// unless told to use a real one. The guests must be made with
	// simlab.ForEncryption.
	TransitPort  int
	TransitToken string
	// TransitCA, when set, is the PEM of the CA the engine's TLS
	// certificate (for 127.0.0.1 and 10.0.2.100) chains to: the engine
	// speaks https, as the lab's Vault server does.
	TransitCA []byte
	// TransitEngine says in the report what the transit engine is (a
	// real Vault/OpenBao, or a fake standing in for one).
	TransitEngine string
}

type story struct {
	o    Options
	env  *simlab.Env
	r    *Report
	ctl  csi.ControllerClient
	a, b *lab.Guest
	// node ids (SMBIOS UUIDs) by guest name
	ids map[string]string

	volID  string
	diskID int64
	// volCtx is the volume context CreateVolume answered (the node calls
	// carry it, as the kubelet passes the PV's).
	volCtx map[string]string
	kind   lab.DiskKind
	// name is the volume's name (its staging path derives from it) and
	// pod the prefix of the pods' names that use it.
	name, pod string
}

const (
	volName = "pvc-e2e-rwo"
	fsType  = "ext4"
)

func stagingPath(vol string) string { return simlab.StagingPath(vol) }

func targetPath(pod string) string {
	return fmt.Sprintf("%s/pods/%s/volumes/kubernetes.io~csi/pv-e2e/mount", simlab.KubeletRoot, pod)
}

// VolumeCapability is what the story's claims ask for: an ext4 filesystem
// on a ReadWriteOnce volume.
func VolumeCapability() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// VolumeRequest asks for a 1 GiB volume named name with VolumeCapability,
// preferring the lab's location, as a claim of the story does; callers add
// parameters or a content source.
func VolumeRequest(name string) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{
		Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
		VolumeCapabilities: []*csi.VolumeCapability{VolumeCapability()},
		AccessibilityRequirements: &csi.TopologyRequirement{
			Preferred: []*csi.Topology{{Segments: map[string]string{driver.TopologyKey: simlab.Location}}},
		},
	}
}

// Run runs the story on a started Env and returns its report. The error
// is for failures of the harness itself; a property that did not hold is
// in the report.
func Run(ctx context.Context, o Options) *Report {
	s := &story{o: o, env: o.Env, r: &Report{Started: time.Now(), Kind: string(lab.SCSIBlock)}, ids: map[string]string{},
		name: volName, pod: "pod-"}
	if o.Env.Backend.Kind != "" {
		s.r.Kind = string(o.Env.Backend.Kind)
	}
	s.kind = lab.DiskKind(s.r.Kind)
	s.r.Setup = o.Env.Lab.SetupTime()
	s.r.Boot = map[string]time.Duration{}
	for _, g := range o.Env.Lab.Guests {
		s.r.Boot[g.Name] = g.BootTime
	}
	err := s.run(ctx)
	s.r.Err = err
	s.collectEvents(context.WithoutCancel(ctx))
	s.r.Finished = time.Now()
	return s.r
}

func (s *story) progress(format string, a ...any) {
	if s.o.Progress != nil {
		fmt.Fprintf(s.o.Progress, format+"\n", a...)
	}
}

// step runs f as one step of the report.
func (s *story) step(scenario, node, name string, f func() (string, error)) error {
	st, err := s.r.Run(scenario, node, name, f)
	mark := "ok  "
	if err != nil {
		mark = "FAIL"
	}
	s.progress("%s %-8s %-11s %s (%.2fs)", mark, scenario, node, name, st.Duration.Seconds())
	return err
}

func (s *story) check(p Property, scenario string, held bool, format string, a ...any) {
	s.r.Check(p, scenario, held, format, a...)
}

func (s *story) run(ctx context.Context) error {
	if len(s.env.Lab.Guests) < 2 {
		return errors.New("the story needs two guests")
	}
	s.a, s.b = s.env.Lab.Guests[0], s.env.Lab.Guests[1]
	ctl, stop, err := s.env.StartController()
	s.ctl = ctl
	if err != nil {
		return fmt.Errorf("starting the controller: %w", err)
	}
	defer stop()

	if err := s.nodeInfo(ctx); err != nil {
		return err
	}
	if s.o.Only != "" {
		return s.runOnly(ctx)
	}
	if err := s.create(ctx); err != nil {
		return err
	}
	sumA, err := s.firstUse(ctx)
	if err != nil {
		return err
	}
	return s.scenarios(ctx, sumA)
}

// nodeInfo asks each guest's node plugin for its node id, which must be
// the guest's SMBIOS UUID.
func (s *story) nodeInfo(ctx context.Context) error {
	for _, g := range []*lab.Guest{s.a, s.b} {
		g := g
		if err := s.step("setup", g.Name, "NodeGetInfo", func() (string, error) {
			var resp csi.NodeGetInfoResponse
			if err := simlab.NodeCall(ctx, g, "NodeGetInfo", &csi.NodeGetInfoRequest{}, &resp); err != nil {
				return "", err
			}
			if !strings.EqualFold(resp.NodeId, g.UUID) {
				return "", fmt.Errorf("node id %s is not the guest's SMBIOS UUID %s", resp.NodeId, g.UUID)
			}
			s.ids[g.Name] = resp.NodeId
			return fmt.Sprintf("node id %s, topology %v", resp.NodeId, resp.GetAccessibleTopology().GetSegments()), nil
		}); err != nil {
			return err
		}
	}
	return nil
}

// storyScenario is one scenario of the lab story and how it runs.
type storyScenario struct {
	Scenario
	// spine: it always runs; the others start from the volume it leaves.
	spine bool
	// alone: it can run by itself on a volume of its own (Options.Only).
	alone bool
	// kindFree: its disks do not follow the run's disk kind.
	kindFree bool
	// cannot, when set, says why the options do not let it run.
	cannot func(o Options) string
	run    func(s *story, ctx context.Context, sumA string) error
}

// storyScenarios are the lab story's scenarios in the order they run on
// the volume created and first used (its data.bin with sha256 sumA).
var storyScenarios = []storyScenario{
	{Scenario: Scenario{"E1", "a second ControllerPublish is refused, naming the VM that has the disk", []Property{P1}}, spine: true,
		run: func(s *story, ctx context.Context, _ string) error { return s.e1(ctx) }},
	{Scenario: Scenario{"E2", "the platform attaches the disk to a second VM anyway: that node's stack refuses it", []Property{P1, P2, P3}}, spine: true,
		run: (*story).e2},
	{Scenario: Scenario{"E3", "a graceful move from node-a to node-b keeps the data", []Property{P5}}, spine: true,
		run: (*story).e3},
	{Scenario: Scenario{"E5", "topology: a volume asked for in another location lands there, and no node here can have it", nil},
		run: func(s *story, ctx context.Context, _ string) error { return s.e5(ctx) }},
	{Scenario: Scenario{"E8", "a volume made from a snapshot holds the data and is not formatted by its stage", []Property{P5}},
		run: (*story).e8},
	{Scenario: Scenario{"E6", "an encrypted volume: LUKS2 on first use with a passphrase the transit engine wraps, opened on the other node", []Property{P5}},
		alone: true, kindFree: true, cannot: noTransit,
		run: func(s *story, ctx context.Context, _ string) error { return s.e6(ctx) }},
	{Scenario: Scenario{"E7", "online expansion of a mounted volume in use", []Property{P5}}, alone: true, kindFree: true,
		run: func(s *story, ctx context.Context, _ string) error { return s.e7(ctx) }},
	{Scenario: Scenario{"E9", "the agent killed at each step of stage and unstage, restarted by systemd", []Property{P4, P5}}, alone: true, kindFree: true,
		run: func(s *story, ctx context.Context, _ string) error { return s.e9(ctx) }},
	{Scenario: Scenario{"E4", "node death: the disk taken over by the other node, the dead node fenced and its late writes refused", []Property{P1, P3, P4, P5}},
		run: (*story).e4},
}

// noTransit: E6 needs a transit engine.
func noTransit(o Options) string {
	if o.TransitPort == 0 {
		return "no transit engine given (vco-lab run starts one unless run with -transit none)"
	}
	return ""
}

// Story are the lab story's scenarios, in the order they run.
var Story = func() []Scenario {
	scs := make([]Scenario, len(storyScenarios))
	for i, sc := range storyScenarios {
		scs[i] = sc.Scenario
	}
	return scs
}()

// KindFree are the ids of the scenarios whose disks do not follow the
// run's disk kind: in a run over several kinds they would only repeat
// themselves.
var KindFree = func() []string {
	var ids []string
	for _, sc := range storyScenarios {
		if sc.kindFree {
			ids = append(ids, sc.ID)
		}
	}
	return ids
}()

// Optional are the ids of the scenarios a run may leave out
// (Options.Skip); the others are the story's spine.
var Optional = func() []string {
	var ids []string
	for _, sc := range storyScenarios {
		if !sc.spine {
			ids = append(ids, sc.ID)
		}
	}
	return ids
}()

// runOnly runs the one scenario the options ask for, on its own.
func (s *story) runOnly(ctx context.Context) error {
	for _, sc := range storyScenarios {
		if sc.ID == s.o.Only && sc.alone {
			s.r.Scenarios = append(s.r.Scenarios, sc.Scenario)
			return sc.run(s, ctx, "")
		}
	}
	return fmt.Errorf("scenario %s cannot run on its own", s.o.Only)
}

// scenarios runs the story's scenarios on the volume created and first
// used (its data.bin with sha256 sumA), each unless left out, and cleans
// up.
func (s *story) scenarios(ctx context.Context, sumA string) error {
	for _, sc := range storyScenarios {
		if !sc.spine && s.o.Skip[sc.ID] {
			s.leftOut(sc.ID, sc.String())
			continue
		}
		if sc.cannot != nil {
			if why := sc.cannot(s.o); why != "" {
				s.r.NotRun = append(s.r.NotRun, sc.String()+": "+why)
				continue
			}
		}
		s.r.Scenarios = append(s.r.Scenarios, sc.Scenario)
		if err := sc.run(s, ctx, sumA); err != nil {
			return err
		}
	}
	return s.cleanup(ctx)
}

// leftOut records in the report that scenario sc was skipped, and why if
// the caller said.
func (s *story) leftOut(sc, what string) {
	why := s.o.SkipWhy[sc]
	if why == "" {
		why = "by request"
	}
	s.r.NotRun = append(s.r.NotRun, what+": left out "+why)
}

func (s *story) create(ctx context.Context) error {
	return s.step("create", "controller", "CreateVolume "+volName+" (1 GiB, preferred "+simlab.Location+")", func() (string, error) {
		v, err := s.createVolume(ctx, VolumeRequest(volName))
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("volume %s, topology %v, LUN file %s", s.volID, v.AccessibleTopology, s.env.Backend.DiskFile(s.diskID)), nil
	})
}

// createVolume makes the volume req asks for (VolumeRequest), records its
// volume and disk ids in s, and has the simulator show its disk as s.kind.
func (s *story) createVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.Volume, error) {
	resp, err := s.ctl.CreateVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	s.volID = resp.Volume.VolumeId
	_, rest, _ := strings.Cut(s.volID, "/")
	if s.diskID, err = strconv.ParseInt(rest, 10, 64); err != nil {
		return nil, fmt.Errorf("volume id %q names no disk id", s.volID)
	}
	s.env.Backend.SetKind(s.diskID, s.kind)
	return resp.Volume, nil
}

func (s *story) publish(ctx context.Context, scenario string, g *lab.Guest) (map[string]string, error) {
	var pc map[string]string
	err := s.step(scenario, "controller", "ControllerPublishVolume to "+g.Name, func() (string, error) {
		resp, err := s.ctl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: s.volID, NodeId: s.ids[g.Name], VolumeCapability: VolumeCapability()})
		if err != nil {
			return "", err
		}
		pc = resp.PublishContext
		return fmt.Sprintf("publish context %v", pc), nil
	})
	return pc, err
}

func (s *story) unpublish(ctx context.Context, scenario string, g *lab.Guest) error {
	return s.step(scenario, "controller", "ControllerUnpublishVolume from "+g.Name, func() (string, error) {
		_, err := s.ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: s.volID, NodeId: s.ids[g.Name]})
		return "", err
	})
}

// kubeletDirs makes the directories the kubelet makes before it calls the
// plugin: the staging path itself and the target path's parent.
func (s *story) kubeletDirs(ctx context.Context, g *lab.Guest, pod string) error {
	_, err := g.MustSh(ctx, "mkdir -p "+stagingPath(s.name)+" "+filepath.Dir(targetPath(pod)))
	return err
}

func (s *story) stage(ctx context.Context, g *lab.Guest, pc map[string]string) error {
	if err := s.kubeletDirs(ctx, g, s.pod+g.Name); err != nil {
		return err
	}
	// The kubelet retries a failed stage with backoff; a disk that the
	// guest has not finished probing after a hot-plug answers NOT_FOUND
	// until it has.
	req := &csi.NodeStageVolumeRequest{VolumeId: s.volID, PublishContext: pc, StagingTargetPath: stagingPath(s.name), VolumeCapability: VolumeCapability(), VolumeContext: s.volCtx}
	deadline := time.Now().Add(90 * time.Second)
	wait := 500 * time.Millisecond
	for tries := 1; ; tries++ {
		err := simlab.KubeletCall(ctx, g, "NodeStageVolume", req, nil)
		if status.Code(err) != codes.NotFound || time.Now().After(deadline) {
			if tries > 1 && err == nil {
				s.progress("         %s: NodeStageVolume succeeded on try %d (the disk was still being probed)", g.Name, tries)
			}
			return err
		}
		time.Sleep(wait)
		wait = min(2*wait, 8*time.Second)
	}
}

func (s *story) stageAndPublish(ctx context.Context, scenario string, g *lab.Guest, pc map[string]string) error {
	if err := s.step(scenario, g.Name, "NodeStageVolume "+s.name, func() (string, error) { return "", s.stage(ctx, g, pc) }); err != nil {
		return err
	}
	return s.step(scenario, g.Name, "NodePublishVolume "+s.name+" into "+s.pod+g.Name, func() (string, error) {
		return "", simlab.KubeletCall(ctx, g, "NodePublishVolume", &csi.NodePublishVolumeRequest{
			VolumeId: s.volID, PublishContext: pc, StagingTargetPath: stagingPath(s.name),
			TargetPath: targetPath(s.pod + g.Name), VolumeCapability: VolumeCapability(), VolumeContext: s.volCtx}, nil)
	})
}

func (s *story) unpublishAndUnstage(ctx context.Context, scenario string, g *lab.Guest) error {
	if err := s.step(scenario, g.Name, "NodeUnpublishVolume", func() (string, error) {
		return "", simlab.KubeletCall(ctx, g, "NodeUnpublishVolume", &csi.NodeUnpublishVolumeRequest{
			VolumeId: s.volID, TargetPath: targetPath(s.pod + g.Name)}, nil)
	}); err != nil {
		return err
	}
	return s.step(scenario, g.Name, "NodeUnstageVolume", func() (string, error) {
		return "", simlab.KubeletCall(ctx, g, "NodeUnstageVolume", &csi.NodeUnstageVolumeRequest{
			VolumeId: s.volID, StagingTargetPath: stagingPath(s.name)}, nil)
	})
}

// takeDown ends a scenario's volume as Kubernetes does when its pod and
// claim go: unpublish and unstage on g, ControllerUnpublish, DeleteVolume.
func (s *story) takeDown(ctx context.Context, scenario string, g *lab.Guest) error {
	if err := s.unpublishAndUnstage(ctx, scenario, g); err != nil {
		return err
	}
	if err := s.unpublish(ctx, scenario, g); err != nil {
		return err
	}
	return s.step(scenario, "controller", "DeleteVolume "+s.volID, func() (string, error) {
		_, err := s.ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: s.volID})
		return "", err
	})
}

// writeFile writes size MiB of random data to the pod's volume, syncs it
// and returns its sha256.
func writeFile(ctx context.Context, g *lab.Guest, pod, name string, mib int) (string, error) {
	p := targetPath(pod) + "/" + name
	out, err := g.MustSh(ctx, fmt.Sprintf("dd if=/dev/urandom of=%s bs=1M count=%d 2>/dev/null && sync && sha256sum %s", p, mib, p))
	if err != nil {
		return "", err
	}
	return strings.Fields(out + " x")[0], nil
}

func readSum(ctx context.Context, g *lab.Guest, pod, name string) (string, error) {
	p := targetPath(pod) + "/" + name
	out, err := g.MustSh(ctx, "echo 3 > /proc/sys/vm/drop_caches; sha256sum "+p)
	if err != nil {
		return "", err
	}
	return strings.Fields(out + " x")[0], nil
}

// readBack is the P5 step of a scenario that moved or copied the volume:
// g reads data.bin in pod, and the property holds when it is the data
// written before (sha256 want). who names the reader in the check, why
// says what a match shows.
func (s *story) readBack(ctx context.Context, sc string, g *lab.Guest, pod, title, want, who, why string) error {
	return s.step(sc, g.Name, title, func() (string, error) {
		sum, err := readSum(ctx, g, pod, "data.bin")
		if err != nil {
			s.check(P5, sc, false, "%s cannot read data.bin: %v", who, err)
			return "", err
		}
		s.check(P5, sc, sum == want, "%s reads data.bin with sha256 %s (written %s): %s", who, sum, want, why)
		if sum != want {
			return "", fmt.Errorf("data.bin sha256 %s, want %s", sum, want)
		}
		return "sha256 " + sum, nil
	})
}

func (s *story) firstUse(ctx context.Context) (string, error) {
	const sc = "first use"
	pc, err := s.publish(ctx, sc, s.a)
	if err != nil {
		return "", err
	}
	if err := s.stageAndPublish(ctx, sc, s.a, pc); err != nil {
		return "", err
	}
	var sum string
	err = s.step(sc, s.a.Name, "write 8 MiB to data.bin in "+s.pod+s.a.Name, func() (string, error) {
		var err error
		sum, err = writeFile(ctx, s.a, s.pod+s.a.Name, "data.bin", 8)
		return "sha256 " + sum, err
	})
	return sum, err
}

// e1: the second ControllerPublish is refused, naming the first VM.
func (s *story) e1(ctx context.Context) error {
	const sc = "E1"
	return s.step(sc, "controller", "ControllerPublishVolume to "+s.b.Name+" while on "+s.a.Name, func() (string, error) {
		cctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		_, err := s.ctl.ControllerPublishVolume(cctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: s.volID, NodeId: s.ids[s.b.Name], VolumeCapability: VolumeCapability()})
		st, _ := status.FromError(err)
		named := strings.Contains(st.Message(), s.a.Name) || strings.Contains(st.Message(), strconv.FormatInt(s.env.VMs[s.a.Name], 10))
		held := err != nil && st.Code() == codes.FailedPrecondition && named
		s.check(P1, sc, held, "second ControllerPublish answered %s: %q", st.Code(), st.Message())
		if !held {
			return "", fmt.Errorf("expected FAILED_PRECONDITION naming %s's VM, got %v", s.a.Name, err)
		}
		return fmt.Sprintf("%s: %s", st.Code(), st.Message()), nil
	})
}

// keyHex is the fence key of guest g as the agent prints it (16 hex
// digits, no prefix).
func keyHex(g *lab.Guest) string {
	k, err := fence.KeyFromUUID(g.UUID)
	if err != nil {
		return "(no key: " + err.Error() + ")"
	}
	return strings.TrimPrefix(k.String(), "0x")
}

// namesHolder reports whether text names guest g: by node name, SMBIOS
// UUID or fence key.
func namesHolder(text string, g *lab.Guest) bool {
	t := strings.ToLower(text)
	return strings.Contains(t, strings.ToLower(g.Name)) || strings.Contains(t, strings.ToLower(g.UUID)) || strings.Contains(t, keyHex(g))
}

// marker is what a node that must not write tries to write; finding any
// of it in the backing file means a write got through.
func marker(node string) []byte {
	unit := []byte(fmt.Sprintf("VCO-LAB-FORBIDDEN-WRITE-FROM-%s-", node))
	return bytes.Repeat(unit, 4096/len(unit)+1)[:4096]
}

// fileContains reports whether the backing file holds the first 64 bytes
// of the marker anywhere.
func fileContains(path string, m []byte) (bool, error) {
	needle := m[:64]
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	buf := make([]byte, 4<<20)
	var tail []byte
	for {
		n, err := f.Read(buf)
		if n > 0 {
			chunk := append(tail, buf[:n]...)
			if bytes.Contains(chunk, needle) {
				return true, nil
			}
			tail = append([]byte(nil), chunk[max(0, len(chunk)-len(needle)):]...)
		}
		if err == io.EOF {
			return false, nil
		}
		if err != nil {
			return false, err
		}
	}
}

// targetOffsets are the 4 KiB blocks forbiddenWrites aims at.
var targetOffsets = []int64{256 * 4096, 512 * 4096}

// targetSums is the sha256 of the backing file's blocks at targetOffsets.
func targetSums(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	buf := make([]byte, 4096)
	for _, off := range targetOffsets {
		if _, err := f.ReadAt(buf, off); err != nil {
			return "", fmt.Errorf("reading %s at %d: %w", path, off, err)
		}
		h.Write(buf)
	}
	return fmt.Sprintf("%x", h.Sum(nil))[:16], nil
}

// forbiddenWrites has g try to write its marker to the raw device dev:
// once as it is, once after clearing the block layer's read-only flag
// (so the write meets the target's reservation). Each attempt must fail.
func forbiddenWrites(ctx context.Context, g *lab.Guest, dev string, targetEnforces bool) (attempts []string, anySucceeded bool, err error) {
	m := marker(g.Name)
	if _, err := g.MustSh(ctx, fmt.Sprintf("printf '%%s' '%s' > /tmp/marker", m)); err != nil {
		return nil, false, err
	}
	tries := []struct{ what, script string }{
		{"dd to " + dev, fmt.Sprintf("dd if=/tmp/marker of=%s bs=4096 count=1 seek=%d oflag=direct conv=fsync", dev, targetOffsets[0]/4096)},
		{"blockdev --setrw then dd to " + dev, fmt.Sprintf("ro=$(cat /sys/block/%s/ro); blockdev --setrw %s; dd if=/tmp/marker of=%s bs=4096 count=1 seek=%d oflag=direct conv=fsync; rc=$?; [ \"$ro\" = 1 ] && blockdev --setro %s; exit $rc", filepath.Base(dev), dev, dev, targetOffsets[1]/4096, dev)},
	}
	if !targetEnforces {
		// Without reservations nothing below the node stops a write that
		// bypasses its agent; the lease protects only through the agent.
		tries = tries[:1]
	}
	for _, try := range tries {
		r, err := g.Sh(ctx, try.script)
		if err != nil {
			return attempts, anySucceeded, err
		}
		res := "refused: " + strings.TrimSpace(lastLine(r.Stderr))
		if r.Exit == 0 {
			res, anySucceeded = "SUCCEEDED", true
		}
		attempts = append(attempts, try.what+": "+res)
	}
	return attempts, anySucceeded, nil
}

// lastLine is the line of a failed command's output that says why: dd's
// own complaint if there is one.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	for _, l := range lines {
		if strings.HasPrefix(l, "dd:") {
			return l
		}
	}
	return lines[len(lines)-1]
}

// e2: the platform attaches the disk to B anyway; B's node stack refuses.
func (s *story) e2(ctx context.Context, sumA string) error {
	const sc = "E2"
	vmB := s.env.VMs[s.b.Name]
	cs := "cs-" + simlab.Location
	var pc map[string]string
	if err := s.step(sc, "platform", "fault allow_multi_attach; attach disk to "+s.b.Name+"'s VM too", func() (string, error) { return s.e2Attach(ctx, cs, vmB, &pc) }); err != nil {
		return err
	}
	var dev string
	if err := s.step(sc, s.b.Name, "wait for the disk to appear (serial "+strconv.FormatInt(s.diskID, 10)+")", func() (string, error) { return s.e2WaitDisk(ctx, &dev) }); err != nil {
		return err
	}
	if err := s.step(sc, s.b.Name, "watch for DiskRefused on arrival, before any NodeStage (10s)", func() (string, error) { return s.e2RefusedOnArrival(ctx, sc) }); err != nil {
		return err
	}
	if err := s.step(sc, s.b.Name, "NodeStageVolume without a grant", func() (string, error) { return s.e2StageRefused(ctx, sc, pc) }); err != nil {
		return err
	}
	if err := s.step(sc, s.b.Name, "refused disk is read-only and not mounted", func() (string, error) { return s.e2ReadOnly(ctx, sc, dev) }); err != nil {
		return err
	}
	if err := s.step(sc, s.b.Name, "DiskRefused event names the holder", func() (string, error) { return s.e2EventNamesHolder(ctx, sc) }); err != nil {
		return err
	}
	if err := s.step(sc, s.b.Name, "try to write to the raw device anyway", func() (string, error) { return s.e2RawWrites(ctx, sc, dev) }); err != nil {
		return err
	}
	if err := s.step(sc, "host", "no byte from "+s.b.Name+" in the backing file; "+s.a.Name+"'s data intact", func() (string, error) { return s.e2DataIntact(ctx, sc, sumA) }); err != nil {
		return err
	}
	return s.step(sc, "platform", "detach the disk from "+s.b.Name+"'s VM; fault off", func() (string, error) {
		defer s.env.Sim.SetFaults(sim.Faults{})
		return "", s.env.Cloud.DetachDisk(ctx, cs, vmB, s.diskID)
	})
}

// e2Attach attaches the disk to B's VM too, as a faulty platform would, and sets pc to what a publish context for B would carry.
func (s *story) e2Attach(ctx context.Context, cs string, vmB int64, pc *map[string]string) (string, error) {
	s.env.Sim.SetFaults(sim.Faults{AllowMultiAttach: true})
	if err := s.env.Cloud.AttachDisk(ctx, cs, vmB, s.diskID); err != nil {
		return "", err
	}
	disks, err := s.env.Cloud.ListVMDisks(ctx, cs, vmB)
	if err != nil {
		return "", err
	}
	for _, d := range disks {
		if d.ID == s.diskID {
			// What a publish context for B would carry; no controller
			// would issue it, and it carries no grant.
			*pc = map[string]string{driver.PubDiskID: strconv.FormatInt(d.ID, 10), driver.PubPCIBus: strconv.Itoa(d.PCIBus),
				driver.PubPCISlot: strconv.Itoa(d.PCISlot), driver.PubSerial: strconv.FormatInt(d.ID, 10)}
		}
	}
	if *pc == nil {
		return "", fmt.Errorf("disk %d not listed on VM %d after attach", s.diskID, vmB)
	}
	return fmt.Sprintf("disk %d on VM %d at PCI %s:%s", s.diskID, vmB, (*pc)[driver.PubPCIBus], (*pc)[driver.PubPCISlot]), nil
}

// e2WaitDisk waits for the disk to appear on B and sets dev to its device.
func (s *story) e2WaitDisk(ctx context.Context, dev *string) (string, error) {
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	d, err := s.b.WaitDiskBySerial(wctx, strconv.FormatInt(s.diskID, 10))
	if err != nil {
		return "", err
	}
	*dev = "/dev/" + d.Name
	return *dev, nil
}

// e2RefusedOnArrival watches B's events for the refusal of the disk on its arrival.
func (s *story) e2RefusedOnArrival(ctx context.Context, sc string) (string, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		evs, err := simlab.Events(ctx, s.b)
		if err != nil {
			return "", err
		}
		for _, ev := range evs {
			if ev.Name() == "DiskRefused" {
				s.check(P2, sc, namesHolder(ev.HolderKey, s.a) || namesHolder(ev.HolderNode, s.a),
					"%s refused the disk on its arrival: %s", s.b.Name, eventFields(ev))
				return eventFields(ev), nil
			}
		}
		if time.Now().After(deadline) {
			// Not a property violation by itself: the refusal at
			// NodeStage below still guards the disk.
			s.r.NotRun = append(s.r.NotRun, "E2 refusal on arrival: "+s.b.Name+"'s agent emitted no DiskRefused within 10s of the disk appearing (no uevent watcher in this agent); the refusal shown is NodeStage's")
			return "no refusal on arrival", nil
		}
		time.Sleep(time.Second)
	}
}

// e2StageRefused stages on B without a grant: refused, naming A.
func (s *story) e2StageRefused(ctx context.Context, sc string, pc map[string]string) (string, error) {
	err := s.stage(ctx, s.b, pc)
	st, _ := status.FromError(err)
	named := namesHolder(st.Message(), s.a)
	held := err != nil && st.Code() == codes.FailedPrecondition
	s.check(P2, sc, held && named, "NodeStage on %s answered %s: %q", s.b.Name, st.Code(), st.Message())
	s.check(P3, sc, err != nil, "%s, holding no grant, did not take the disk over from %s", s.b.Name, s.a.Name)
	if !held {
		return "", fmt.Errorf("expected FAILED_PRECONDITION, got %v", err)
	}
	return fmt.Sprintf("%s: %s", st.Code(), st.Message()), nil
}

// e2ReadOnly checks that the refused disk is read-only and not mounted on B.
func (s *story) e2ReadOnly(ctx context.Context, sc, dev string) (string, error) {
	out, err := s.b.MustSh(ctx, fmt.Sprintf("cat /sys/block/%s/ro; grep -c ' %s ' /proc/mounts || true", filepath.Base(dev), stagingPath(s.name)))
	if err != nil {
		return "", err
	}
	f := strings.Fields(out)
	ro, mounted := len(f) > 0 && f[0] == "1", len(f) > 1 && f[1] != "0"
	s.check(P2, sc, ro, "%s's %s read-only flag after the refusal: %v", s.b.Name, dev, ro)
	s.check(P2, sc, !mounted, "nothing mounted at %s's staging path: %v", s.b.Name, !mounted)
	return fmt.Sprintf("ro=%v mounted=%v", ro, mounted), nil
}

// e2EventNamesHolder finds the DiskRefused event naming A on B.
func (s *story) e2EventNamesHolder(ctx context.Context, sc string) (string, error) {
	evs, err := simlab.Events(ctx, s.b)
	if err != nil {
		return "", err
	}
	for _, ev := range evs {
		if ev.Name() == "DiskRefused" && (namesHolder(ev.HolderNode, s.a) || namesHolder(ev.HolderKey, s.a)) {
			s.check(P2, sc, true, "%s emitted DiskRefused holder_node=%s holder_key=%s", s.b.Name, ev.HolderNode, ev.HolderKey)
			return eventFields(ev), nil
		}
	}
	s.check(P2, sc, false, "%s emitted no DiskRefused naming %s (node or key %s) among %d events", s.b.Name, s.a.Name, keyHex(s.a), len(evs))
	return "", fmt.Errorf("no DiskRefused naming %s among %d events", s.a.Name, len(evs))
}

// e2RawWrites has B write to the raw device anyway; no block of the backing file may change.
func (s *story) e2RawWrites(ctx context.Context, sc, dev string) (string, error) {
	file := s.env.Backend.DiskFile(s.diskID)
	before, err := targetSums(file)
	if err != nil {
		return "", err
	}
	attempts, ok, err := forbiddenWrites(ctx, s.b, dev, s.kind == lab.SCSIBlock)
	if err != nil {
		return "", err
	}
	after, err := targetSums(file)
	if err != nil {
		return "", err
	}
	s.check(P1, sc, !ok, "%s's raw writes while %s holds the disk: %s", s.b.Name, s.a.Name, strings.Join(attempts, "; "))
	s.check(P1, sc, before == after, "sha256 of the backing file's blocks %s aimed at: before %s, after %s", s.b.Name, before, after)
	return strings.Join(attempts, "\n"), nil
}

// e2DataIntact checks the backing file for B's marker and A's data.
func (s *story) e2DataIntact(ctx context.Context, sc, sumA string) (string, error) {
	found, err := fileContains(s.env.Backend.DiskFile(s.diskID), marker(s.b.Name))
	if err != nil {
		return "", err
	}
	s.check(P1, sc, !found, "backing file %s holds %s's marker: %v", s.env.Backend.DiskFile(s.diskID), s.b.Name, found)
	sum, err := readSum(ctx, s.a, s.pod+s.a.Name, "data.bin")
	if err != nil {
		return "", err
	}
	s.check(P1, sc, sum == sumA, "%s reads data.bin back with sha256 %s (wrote %s)", s.a.Name, sum, sumA)
	if found || sum != sumA {
		return "", fmt.Errorf("marker found=%v, data.bin %s want %s", found, sum, sumA)
	}
	return "", nil
}

// e3: graceful move from A to B.
func (s *story) e3(ctx context.Context, sumA string) error {
	const sc = "E3"
	if err := s.unpublishAndUnstage(ctx, sc, s.a); err != nil {
		return err
	}
	if err := s.unpublish(ctx, sc, s.a); err != nil {
		return err
	}
	pc, err := s.publish(ctx, sc, s.b)
	if err != nil {
		return err
	}
	if err := s.stageAndPublish(ctx, sc, s.b, pc); err != nil {
		return err
	}
	return s.readBack(ctx, sc, s.b, s.pod+s.b.Name, "read data.bin written on "+s.a.Name, sumA,
		"after the move "+s.b.Name, "staging found the filesystem and did not format")
}

// e5: a volume asked for in another location lands there, and a node of
// this location cannot have it.
func (s *story) e5(ctx context.Context) error {
	const sc = "E5"
	const other = "ch-gen-1"
	var id string
	if err := s.step(sc, "controller", "CreateVolume pvc-e2e-elsewhere (requisite "+other+")", func() (string, error) {
		req := VolumeRequest("pvc-e2e-elsewhere")
		req.AccessibilityRequirements = &csi.TopologyRequirement{
			Requisite: []*csi.Topology{{Segments: map[string]string{driver.TopologyKey: other}}},
		}
		resp, err := s.ctl.CreateVolume(ctx, req)
		if err != nil {
			return "", err
		}
		id = resp.Volume.VolumeId
		segs := resp.Volume.GetAccessibleTopology()
		if len(segs) != 1 || segs[0].Segments[driver.TopologyKey] != other || !strings.HasPrefix(id, other+"/") {
			return "", fmt.Errorf("volume %s with topology %v, want location %s", id, segs, other)
		}
		return fmt.Sprintf("volume %s, topology %v: the PV's node affinity keeps pods off %s", id, segs, simlab.Location), nil
	}); err != nil {
		return err
	}
	if err := s.step(sc, "controller", "ControllerPublishVolume to "+s.a.Name+" ("+simlab.Location+")", func() (string, error) {
		_, err := s.ctl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: id, NodeId: s.ids[s.a.Name], VolumeCapability: VolumeCapability()})
		st, _ := status.FromError(err)
		if st.Code() != codes.FailedPrecondition {
			return "", fmt.Errorf("expected FAILED_PRECONDITION, got %v", err)
		}
		return st.Message(), nil
	}); err != nil {
		return err
	}
	return s.step(sc, "controller", "DeleteVolume "+id, func() (string, error) {
		_, err := s.ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		return "", err
	})
}

// e8: a snapshot of the volume (in use on B), a new volume from it staged
// on A: the data is there, and staging did not format it.
func (s *story) e8(ctx context.Context, sumA string) error {
	const sc = "E8"
	var snapID string
	if err := s.step(sc, "controller", "CreateSnapshot of "+s.volID, func() (string, error) {
		if _, err := s.b.MustSh(ctx, "sync"); err != nil {
			return "", err
		}
		resp, err := s.ctl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: s.volID, Name: "snap-e2e"})
		if err != nil {
			return "", err
		}
		snapID = resp.Snapshot.SnapshotId
		return "snapshot " + snapID, nil
	}); err != nil {
		return err
	}
	c := *s
	c.name, c.pod = "pvc-e2e-clone", "pod-clone-"
	if err := s.step(sc, "controller", "CreateVolume pvc-e2e-clone from the snapshot", func() (string, error) {
		req := VolumeRequest(c.name)
		req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}}
		resp, err := s.ctl.CreateVolume(ctx, req)
		if err != nil {
			return "", err
		}
		c.volID = resp.Volume.VolumeId
		return "volume " + c.volID, nil
	}); err != nil {
		return err
	}
	pc, err := c.publish(ctx, sc, s.a)
	if err != nil {
		return err
	}
	if err := c.stageAndPublish(ctx, sc, s.a, pc); err != nil {
		return err
	}
	if err := s.readBack(ctx, sc, s.a, c.pod+s.a.Name, "read data.bin on the new volume", sumA,
		"the volume made from a snapshot, on "+s.a.Name+",", "staging did not format it"); err != nil {
		return err
	}
	if err := c.unpublishAndUnstage(ctx, sc, s.a); err != nil {
		return err
	}
	if err := c.unpublish(ctx, sc, s.a); err != nil {
		return err
	}
	return s.step(sc, "controller", "DeleteVolume "+c.volID+", DeleteSnapshot "+snapID, func() (string, error) {
		if _, err := s.ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: c.volID}); err != nil {
			return "", err
		}
		_, err := s.ctl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snapID})
		return "", err
	})
}

// e4: B (the holder now) is lost to the controller without releasing; the
// disk moves to A with a grant; B is fenced.
//
// On scsi-block B is frozen (QMP stop) and resumed after the takeover: the
// target's reservation refuses whatever it writes. On virtio-blk the lease
// fences only through B's agent, which must see the lease taken, so B is
// stopped only while the platform detaches the disk in its API and runs
// again before the takeover: A's takeover waits until B's agent has seen
// A's claim and fenced itself, and B's writes after that must all fail. A
// guest frozen by its hypervisor cannot be fenced by a lease at all (its
// clocks stop with it, so on resuming it writes before its agent's next
// renewal notices); on that disk kind only a detach at the hypervisor
// stops it, and the report says so.
func (s *story) e4(ctx context.Context, sumA string) error {
	const sc = "E4"
	dead, live := s.b, s.a
	frozen := s.kind == lab.SCSIBlock
	var dev string
	if !frozen {
		s.r.NotRun = append(s.r.NotRun, "E4 frozen holder: on "+string(s.kind)+" a guest frozen by its hypervisor while it holds the lease, "+
			"and resumed with the disk still attached after the takeover, writes before its agent's next renewal sees the lease taken "+
			"(its clocks stood still, so it cannot have fenced itself in time); the lease cannot stop that, only a detach at the "+
			"hypervisor (or reservations, scsi-block) can, so E4 shows the lease fencing a holder that keeps running")
	}
	if err := s.step(sc, dead.Name, "find the device; stop the guest (QMP stop)", func() (string, error) {
		d, err := dead.DiskBySerial(ctx, strconv.FormatInt(s.diskID, 10))
		if err != nil {
			return "", err
		}
		dev = "/dev/" + d.Name
		return dev, dead.Pause(ctx)
	}); err != nil {
		return err
	}
	resumed := false
	defer func() {
		if !resumed {
			_ = dead.Resume(context.WithoutCancel(ctx))
		}
	}()
	if err := s.unpublish(ctx, sc+" (force detach)", dead); err != nil {
		return err
	}
	if !frozen {
		// The platform has detached the disk in its API only (the guest
		// was stopped), so it comes back still seeing the disk and holding
		// the lease, its agent renewing it.
		if err := s.step(sc, dead.Name, "resume the guest before the takeover (QMP cont); it still has the disk", func() (string, error) {
			if err := dead.Resume(ctx); err != nil {
				return "", err
			}
			resumed = true
			return "", nil
		}); err != nil {
			return err
		}
	}
	sum2, err := s.e4TakeOver(ctx, sc, live, sumA)
	if err != nil {
		return err
	}
	if frozen {
		if err := s.step(sc, dead.Name, "resume the guest (QMP cont); it tries to write", func() (string, error) {
			if err := dead.Resume(ctx); err != nil {
				return "", err
			}
			resumed = true
			out, _, err := s.e4LateWrites(ctx, dead, dev)
			return out, err
		}); err != nil {
			return err
		}
	}
	if err := s.e4Fenced(ctx, sc, dead); err != nil {
		return err
	}
	if !frozen {
		if err := s.e4WritesRefused(ctx, sc, dead, dev); err != nil {
			return err
		}
	}
	if err := s.e4Inaccessible(ctx, sc, dead); err != nil {
		return err
	}
	if err := s.e4KubeletCleanup(ctx, sc, dead); err != nil {
		return err
	}
	if err := s.e4Keys(ctx, sc, dead, live); err != nil {
		return err
	}
	return s.e4NoLateWrite(ctx, sc, dead, live, sum2)
}

// e4TakeOver publishes to live with the controller's grant, stages there
// and writes after.bin, whose sha256 it returns, checking data.bin.
func (s *story) e4TakeOver(ctx context.Context, sc string, live *lab.Guest, sumA string) (string, error) {
	pc, err := s.publish(ctx, sc, live)
	if err != nil {
		return "", err
	}
	grant := pc[driver.PubFenceGrant]
	s.check(P3, sc, grant != "", "the controller's publish to %s carries a grant: %s", live.Name, grant)
	if err := s.stageAndPublish(ctx, sc, live, pc); err != nil {
		return "", err
	}
	var sum2 string
	if err := s.step(sc, live.Name, "write after.bin; data.bin intact", func() (string, error) {
		var err error
		if sum2, err = writeFile(ctx, live, s.pod+live.Name, "after.bin", 4); err != nil {
			return "", err
		}
		sum, err := readSum(ctx, live, s.pod+live.Name, "data.bin")
		if err != nil {
			return "", err
		}
		s.check(P5, sc, sum == sumA, "after the takeover %s reads data.bin with sha256 %s (written %s)", live.Name, sum, sumA)
		return "after.bin sha256 " + sum2, nil
	}); err != nil {
		return "", err
	}
	return sum2, nil
}

// e4LateWrites has dead write its marker through its mount and to the
// raw device dev; it answers whether each write failed.
func (s *story) e4LateWrites(ctx context.Context, dead *lab.Guest, dev string) (string, bool, error) {
	m := marker(dead.Name)
	script := fmt.Sprintf("printf '%%s' '%s' > /tmp/marker; dd if=/tmp/marker of=%s/late.bin bs=4096 count=64 conv=fsync 2>&1; fs=$?; sync; dd if=/tmp/marker of=%s bs=4096 count=1 seek=768 oflag=direct 2>&1; echo fs=$fs raw=$?",
		m, targetPath(s.pod+dead.Name), dev)
	r, err := dead.Sh(ctx, script)
	if err != nil {
		return "", false, err
	}
	out := strings.TrimSpace(r.Stdout + r.Stderr)
	f := strings.Fields(out[strings.LastIndex(out, "\n")+1:])
	refused := len(f) == 2 && f[0] != "fs=0" && f[1] != "raw=0"
	return out, refused, nil
}

// e4Fenced waits for dead's DiskFenced event.
func (s *story) e4Fenced(ctx context.Context, sc string, dead *lab.Guest) error {
	return s.step(sc, dead.Name, "DiskFenced within 60s", func() (string, error) {
		deadline := time.Now().Add(60 * time.Second)
		for {
			evs, err := simlab.Events(ctx, dead)
			if err != nil {
				return "", err
			}
			for _, ev := range evs {
				if ev.Name() == "DiskFenced" {
					s.check(P4, sc, true, "%s emitted DiskFenced: %s", dead.Name, eventFields(ev))
					return eventFields(ev), nil
				}
			}
			if time.Now().After(deadline) {
				s.check(P4, sc, false, "%s emitted no DiskFenced within 60s of resuming", dead.Name)
				return "", errors.New("no DiskFenced")
			}
			time.Sleep(2 * time.Second)
		}
	})
}

// e4WritesRefused checks that dead's writes after it fenced itself fail.
func (s *story) e4WritesRefused(ctx context.Context, sc string, dead *lab.Guest, dev string) error {
	return s.step(sc, dead.Name, "it tries to write after fencing itself: through its mount and to the raw device", func() (string, error) {
		out, refused, err := s.e4LateWrites(ctx, dead, dev)
		if err != nil {
			return "", err
		}
		s.check(P4, sc, refused, "%s's writes after it fenced itself (its mount, then %s): %s", dead.Name, dev, strings.ReplaceAll(out, "\n", "; "))
		if !refused {
			return out, fmt.Errorf("a write from fenced %s succeeded", dead.Name)
		}
		return out, nil
	})
}

// e4Inaccessible checks that the node plugin on dead reports the volume
// inaccessible.
func (s *story) e4Inaccessible(ctx context.Context, sc string, dead *lab.Guest) error {
	return s.step(sc, dead.Name, "volume reported inaccessible (NodeGetVolumeHealth)", func() (string, error) {
		var resp csi.NodeGetVolumeHealthResponse
		err := simlab.NodeCall(ctx, dead, "NodeGetVolumeHealth", &csi.NodeGetVolumeHealthRequest{VolumeId: s.volID,
			StagingTargetPath: stagingPath(s.name), VolumePublishPath: targetPath(s.pod + dead.Name)}, &resp)
		if err != nil {
			return "", err
		}
		var got []string
		for _, h := range resp.GetVolumeHealth().GetHealthStatuses() {
			got = append(got, fmt.Sprintf("%s %s: %s", h.Status, h.Reason, h.Message))
		}
		s.check(P4, sc, len(got) > 0, "volume health on fenced %s: %v", dead.Name, got)
		return strings.Join(got, "; "), nil
	})
}

// e4KubeletCleanup makes the calls the kubelet makes on the fenced node.
func (s *story) e4KubeletCleanup(ctx context.Context, sc string, dead *lab.Guest) error {
	return s.step(sc, dead.Name, "the kubelet cleans up on the fenced node: NodeUnpublishVolume, NodeUnstageVolume", func() (string, error) {
		// Past one periodic check of the agent (10 s), so a re-registration
		// it might make by itself would have happened.
		time.Sleep(12 * time.Second)
		if err := simlab.NodeCall(ctx, dead, "NodeUnpublishVolume", &csi.NodeUnpublishVolumeRequest{
			VolumeId: s.volID, TargetPath: targetPath(s.pod + dead.Name)}, nil); err != nil {
			return "", err
		}
		err := simlab.NodeCall(ctx, dead, "NodeUnstageVolume", &csi.NodeUnstageVolumeRequest{VolumeId: s.volID, StagingTargetPath: stagingPath(s.name)}, nil)
		if err != nil {
			return "", err
		}
		return "", nil
	})
}

// e4Keys checks, on scsi-block, that only live's key is registered.
func (s *story) e4Keys(ctx context.Context, sc string, dead, live *lab.Guest) error {
	if s.kind != lab.SCSIBlock {
		s.r.NotRun = append(s.r.NotRun, "E4 registered keys: "+string(s.kind)+" disks have no reservations to read")
		return nil
	}
	return s.step(sc, live.Name, "registered keys on the disk (sg_persist --read-keys)", func() (string, error) {
		d, err := live.DiskBySerial(ctx, strconv.FormatInt(s.diskID, 10))
		if err != nil {
			return "", err
		}
		out, err := live.MustSh(ctx, "sg_persist --in --read-keys /dev/"+d.Name+"; sg_persist --in --read-reservation /dev/"+d.Name)
		if err != nil {
			return "", err
		}
		low := strings.ToLower(out)
		deadKey, liveKey := keyHex(dead), keyHex(live)
		s.check(P4, sc, !strings.Contains(low, deadKey), "fenced %s's key %s is not registered again after resuming, a periodic check and its cleanup", dead.Name, deadKey)
		s.check(P1, sc, strings.Contains(low, liveKey), "the reservation is %s's (key %s)", live.Name, liveKey)
		return strings.TrimSpace(out), nil
	})
}

// e4NoLateWrite checks the disk's backing file for dead's marker and
// live's data.
func (s *story) e4NoLateWrite(ctx context.Context, sc string, dead, live *lab.Guest, sum2 string) error {
	return s.step(sc, "host", "none of "+dead.Name+"'s late writes landed; "+live.Name+"'s data intact", func() (string, error) {
		found, err := fileContains(s.env.Backend.DiskFile(s.diskID), marker(dead.Name))
		if err != nil {
			return "", err
		}
		s.check(P4, sc, !found, "backing file holds %s's marker written after it lost the disk: %v", dead.Name, found)
		s.check(P1, sc, !found, "no write from fenced %s reached the disk while %s holds it", dead.Name, live.Name)
		sum, err := readSum(ctx, live, s.pod+live.Name, "after.bin")
		if err != nil {
			return "", err
		}
		s.check(P1, sc, sum == sum2, "%s reads after.bin back with sha256 %s (wrote %s)", live.Name, sum, sum2)
		if found || sum != sum2 {
			return "", fmt.Errorf("marker found=%v, after.bin %s want %s", found, sum, sum2)
		}
		return "", nil
	})
}

// cleanup unpublishes everywhere and deletes the volume, as Kubernetes does
// when the claim goes.
func (s *story) cleanup(ctx context.Context) error {
	const sc = "cleanup"
	holder := s.b
	if !s.o.Skip["E4"] {
		holder = s.a
	}
	if err := s.unpublishAndUnstage(ctx, sc, holder); err != nil {
		return err
	}
	if err := s.unpublish(ctx, sc, holder); err != nil {
		return err
	}
	return s.step(sc, "controller", "DeleteVolume", func() (string, error) {
		_, err := s.ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: s.volID})
		return "", err
	})
}

func (s *story) collectEvents(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, g := range s.env.Lab.Guests {
		evs, err := simlab.Events(cctx, g)
		if err != nil {
			s.r.NotRun = append(s.r.NotRun, fmt.Sprintf("events of %s: %v", g.Name, err))
			continue
		}
		s.r.Events = append(s.r.Events, evs...)
	}
}
