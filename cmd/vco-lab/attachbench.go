package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"

	"github.com/whitesky-cloud/vco-storage/integration/e2e"
	"github.com/whitesky-cloud/vco-storage/integration/guestexec"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/simlab"
)

// Attach-to-staged latency: from ControllerPublishVolume (the simulator
// hot-plugs the disk into the guest over QMP) until the volume is a
// mounted filesystem in the guest. The node stack's way is NodeStageVolume
// through the node plugin to the agent (uevent, device verification,
// reservation or lease, claim, mkfs on first use, mount). The reference,
// measured in the same run on the same guest, is the same hot-plug
// followed by the least a person would do by hand: wait for the device
// node of the disk's serial, mkfs.ext4 with the options the agent uses
// (mount-utils: -F -m0), mount. Every round uses a new blank volume, so
// both sides make a filesystem; the two sides alternate which goes first.

// byHandStage is the reference's guest side: $1 the disk's serial, $2 the
// mount point. The guests run no udev, so it reads serials from sysfs, as
// lab.Guest.Disks does; tgt pads the SCSI unit serial with spaces.
const byHandStage = `ser=$1; dir=$2; dev=
while [ -z "$dev" ]; do
	for b in /sys/block/sd* /sys/block/vd*; do
		[ -e "$b" ] || continue
		s=
		[ -r "$b/serial" ] && s=$(cat "$b/serial")
		[ -z "$s" ] && [ -r "$b/device/vpd_pg80" ] && s=$(tail -c +5 "$b/device/vpd_pg80" | tr -d '\000 ')
		[ "$s" = "$ser" ] && dev=/dev/${b##*/}
	done
	[ -n "$dev" ] || sleep 0.1
done
while [ ! -b "$dev" ]; do sleep 0.1; done
mkfs.ext4 -q -F -m0 "$dev" && mkdir -p "$dir" && mount -t ext4 "$dev" "$dir"`

// attachKind is one of the lab's disk kinds with the fencing the agent
// uses on it.
type attachKind struct {
	kind    lab.DiskKind
	fencing string
}

// attachKinds are the kinds attach-to-staged runs on.
var attachKinds = []attachKind{
	{lab.SCSIBlock, "PR"},
	{lab.VirtioBlk, "lease"},
}

// attachBench runs rounds of both sides for every disk kind on one guest
// and returns the table rows: per kind, the reference then the agent's
// row, each the median of its rounds (each round is printed first).
func attachBench(ctx context.Context, c *common, rounds int) ([]benchRow, error) {
	cfg, err := simLabConfig(c, false)
	if err != nil {
		return nil, err
	}
	env, err := simlab.Start(ctx, simlab.Options{Lab: cfg, Guests: []string{"node-a"}})
	if err != nil {
		return nil, fmt.Errorf("starting the lab for attach-to-staged: %w", err)
	}
	defer func() {
		if err := env.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "vco-lab: teardown:", err)
		}
	}()
	ctl, stop, err := env.StartController()
	if err != nil {
		return nil, fmt.Errorf("starting the controller: %w", err)
	}
	defer stop()
	g := env.Lab.Guests[0]
	var info csi.NodeGetInfoResponse
	if err := simlab.NodeCall(ctx, g, "NodeGetInfo", &csi.NodeGetInfoRequest{}, &info); err != nil {
		return nil, err
	}
	b := &attachRun{env: env, ctl: ctl, g: g, node: info.NodeId}
	// The stages go through a standing caller in the guest, connected to
	// the plugin as the kubelet is: a call costs the guest one shell, as
	// the reference's commands do, not a Go program's start.
	if err := simlab.StartCaller(ctx, g); err != nil {
		return nil, err
	}
	if err := roundTrips(ctx, g); err != nil {
		return nil, err
	}
	var rows []benchRow
	for _, k := range attachKinds {
		r, err := b.kindRows(ctx, k, rounds)
		if err != nil {
			return nil, err
		}
		rows = append(rows, r...)
	}
	return rows, nil
}

// roundTrips prints the median of three round trips into g by each way
// a call can get there, for a reader to weigh the rounds' times.
func roundTrips(ctx context.Context, g *lab.Guest) error {
	var info csi.NodeGetInfoResponse
	for _, c := range []struct {
		how  string
		call func() error
	}{
		{"a new csi-call process", func() error { return simlab.NodeCall(ctx, g, "NodeGetInfo", &csi.NodeGetInfoRequest{}, &info) }},
		{"the standing caller, the way each NodeStageVolume is made", func() error {
			return simlab.CallerCall(ctx, g, "NodeGetInfo", &csi.NodeGetInfoRequest{}, &info)
		}},
		{"a shell alone, the way the reference starts", func() error { _, err := g.MustSh(ctx, "true"); return err }},
	} {
		var calls []time.Duration
		for i := 0; i < 3; i++ {
			start := time.Now()
			if err := c.call(); err != nil {
				return err
			}
			calls = append(calls, time.Since(start))
		}
		fmt.Printf("a round trip into the guest through %s: %s median\n", c.how, secs(median(calls)))
	}
	return nil
}

// kindRows runs rounds of attach-to-staged on disks of kind k, through
// the agent and by hand in alternating order, and gives the medians' rows.
func (b *attachRun) kindRows(ctx context.Context, k attachKind, rounds int) ([]benchRow, error) {
	var agent, byHand []time.Duration
	for i := 0; i < rounds; i++ {
		sides := []bool{true, false}
		if i%2 == 1 {
			sides = []bool{false, true}
		}
		for _, viaAgent := range sides {
			d, err := b.round(ctx, k.kind, viaAgent, fmt.Sprintf("%s-%d", k.kind, i))
			if err != nil {
				return nil, err
			}
			who := "by hand"
			if viaAgent {
				agent = append(agent, d)
				who = "agent"
			} else {
				byHand = append(byHand, d)
			}
			fmt.Printf("attach-to-staged %s round %d, %s: %s\n", k.kind, i+1, who, secs(d))
			if viaAgent {
				fmt.Printf("  agent: %s\n", b.stagedSteps(ctx))
			}
		}
	}
	ref, got := median(byHand), median(agent)
	return []benchRow{
		{fmt.Sprintf("attach-to-staged %s, hot-plug then device wait, mkfs.ext4, mount by hand (reference)", k.kind), secs(ref), "1.00x"},
		{fmt.Sprintf("attach-to-staged %s, ControllerPublish to NodeStage done (agent, %s)", k.kind, k.fencing), secs(got), ratio(got, ref)},
	}, nil
}

type attachRun struct {
	env  *simlab.Env
	ctl  csi.ControllerClient
	g    *lab.Guest
	node string
}

// round makes a blank 1 GiB volume of the given kind, times publish to
// mounted (through the agent or by hand), then takes it all down again.
func (b *attachRun) round(ctx context.Context, kind lab.DiskKind, viaAgent bool, name string) (time.Duration, error) {
	name = "pvc-bench-" + name
	if !viaAgent {
		name += "-ref"
	}
	resp, err := b.ctl.CreateVolume(ctx, e2e.VolumeRequest(name))
	if err != nil {
		return 0, fmt.Errorf("CreateVolume %s: %w", name, err)
	}
	volID := resp.Volume.VolumeId
	_, rest, _ := strings.Cut(volID, "/")
	diskID, err := strconv.ParseInt(rest, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("volume id %q names no disk id", volID)
	}
	b.env.Backend.SetKind(diskID, kind)
	staging := simlab.StagingPath(name)
	if _, err := b.g.MustSh(ctx, "mkdir -p "+staging); err != nil {
		return 0, err
	}

	start := time.Now()
	pub, err := b.ctl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: volID, NodeId: b.node, VolumeCapability: e2e.VolumeCapability()})
	if err != nil {
		return 0, fmt.Errorf("ControllerPublishVolume %s: %w", volID, err)
	}
	if viaAgent {
		var last time.Time
		last, err = stageWhenPresent(ctx, b.g, &csi.NodeStageVolumeRequest{VolumeId: volID, PublishContext: pub.PublishContext,
			StagingTargetPath: staging, VolumeCapability: e2e.VolumeCapability(), VolumeContext: resp.Volume.VolumeContext})
		fmt.Printf("  publish to the last NodeStageVolume call: %s; that call: %s\n", secs(last.Sub(start)), secs(time.Since(last)))
	} else {
		var r *guestexec.Result
		r, err = b.g.Exec().Run(ctx, 2*time.Minute, "/bin/sh", "-c", byHandStage, "bench", strconv.FormatInt(diskID, 10), staging)
		if err == nil && (r.Exit != 0 || r.TimedOut) {
			err = fmt.Errorf("by hand in %s: %s", b.g.Name, r)
		}
	}
	took := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("volume %s (%s): %w", volID, kind, err)
	}

	if viaAgent {
		err = simlab.KubeletCall(ctx, b.g, "NodeUnstageVolume", &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}, nil)
	} else {
		_, err = b.g.MustSh(ctx, "umount "+staging)
	}
	if err != nil {
		return 0, fmt.Errorf("unstaging %s: %w", volID, err)
	}
	if _, err := b.ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: b.node}); err != nil {
		return 0, fmt.Errorf("ControllerUnpublishVolume %s: %w", volID, err)
	}
	if _, err := b.ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: volID}); err != nil {
		return 0, fmt.Errorf("DeleteVolume %s: %w", volID, err)
	}
	return took, nil
}

// stagedSteps is where the agent's last stage spent its time: the steps
// of its "volume staged" log line (agent/volume), or why they are missing.
func (b *attachRun) stagedSteps(ctx context.Context) string {
	out, err := b.g.MustSh(ctx, "grep 'volume staged' /var/log/vco-agent.log | tail -n 1")
	if err != nil {
		return fmt.Sprintf("no stage logged (%v)", err)
	}
	if _, steps, ok := strings.Cut(out, "steps="); ok {
		return strings.TrimSpace(steps)
	}
	return strings.TrimSpace(out)
}

// stageWhenPresent calls NodeStageVolume until the hot-plugged disk has
// been probed: the agent waits for it (volumes.attach_wait) and answers
// NOT_FOUND past that, and then the call is made again, as the kubelet
// retries; every 100 ms, the reference's polling interval, rather than
// with the kubelet's backoff, so that both sides wait alike.
// It returns when its last call began: until then the disk was not there.
func stageWhenPresent(ctx context.Context, g *lab.Guest, req *csi.NodeStageVolumeRequest) (time.Time, error) {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		last := time.Now()
		err := simlab.CallerCall(ctx, g, "NodeStageVolume", req, nil)
		if grpcstatus.Code(err) == codes.Aborted {
			err = simlab.KubeletCall(ctx, g, "NodeStageVolume", req, nil)
		}
		if grpcstatus.Code(err) != codes.NotFound || time.Now().After(deadline) {
			return last, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}
