package volume

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/fence"
)

// Node B, which fences with the on-disk lease, holds a disk: its lease is
// live and renewed, its volume mounted. Node A runs with
// volumes.fence_methods [none] (the reference of the cluster benchmarks;
// [scsi-pr] alone reads the same on a disk without reservations) and
// volumes.allow_unfenced, and a stage on A with the request's opt-in is
// given the same disk. Fencing.Choose, told A does not use the lease, never
// reads the lease area: the choice is "no fencing", leaseDataRule only
// moves the data past the lease area B's lease sits in, and A's stage
// mounts B's filesystem read-write, unfenced, while B holds the lease and
// writes it: two writers (P2). docs/agent.md says another node's
// reservation or lease is read and refused whichever methods are named,
// and a look (Classify) on A does refuse this disk naming B; the stage
// does not look. The unfenced opt-in is for a disk that offers no
// fencing, not for one another node holds.
func TestAdv24AgentWithoutTheLeaseStagesADiskAnotherNodeHoldsByItsLease(t *testing.T) {
	for name, uses := range map[string]fence.Method{"none": fence.MethodNone, "scsi-pr": fence.MethodPR} {
		t.Run(name, func(t *testing.T) { adv24StageHeldByLease(t, uses) })
	}
}

func adv24StageHeldByLease(t *testing.T, uses fence.Method) {
	needRoot(t)
	ctx := context.Background()
	b := fencedLeaseEnv(t, nodeB, "node-b")
	imgB, _ := loop(t, 64)
	if _, err := b.m.Stage(ctx, b.stageReq("vol-b", imgB, "b")); err != nil {
		t.Fatal(err)
	}

	f := leaseFencing(nodeA, "node-a")
	f.Use = func(m fence.Method) bool { return m == uses }
	a := newEnvWith(t, f)
	link, devA := shared(t, imgB)
	if v, err := a.m.Classify(ctx, devEvent(t, devA)); err != nil || !v.Refuse || v.Holder != keyB {
		t.Fatalf("control: A's look at the disk B holds: %+v %v", v, err)
	}
	req := a.stageReq("vol-a", link, "a")
	req.AllowUnfenced = true
	res, err := a.m.Stage(ctx, req)
	if err == nil {
		t.Fatalf("node A (fence_methods [%s]) staged (%+v, mounted at %s) the disk node B holds by its live lease: the stage must refuse a disk another node holds, whichever methods A claims with", uses, res, req.StagingPath)
	}
	wantCode(t, err, codes.FailedPrecondition)
}
