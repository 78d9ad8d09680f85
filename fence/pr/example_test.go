package pr_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
	"github.com/whitesky-cloud/vco-storage/fence/scsi/scsitest"
)

// Two nodes share one LUN. The transport here is the model target; on a
// node it is scsi.OpenSGIO("/dev/sdX") or discovery's Opened.SCSI.
func Example() {
	ctx := context.Background()
	lun := scsitest.New(scsitest.Options{NoPreemptAndAbort: true}) // like tgt

	keyA, _ := fence.KeyFromUUID("4c4c4544-0042-3610-8052-b4c04f4e3332")
	keyB, _ := fence.KeyFromUUID("8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab")
	nodes, _ := fence.NewDirectory(map[string]string{"node-a": "4c4c4544-0042-3610-8052-b4c04f4e3332"})

	a, _ := pr.New("/dev/sdb", lun.Initiator("iqn.a"), pr.Config{Key: keyA, Node: "4c4c4544-0042-3610-8052-b4c04f4e3332"})
	b, _ := pr.New("/dev/sdb", lun.Initiator("iqn.b"), pr.Config{Key: keyB, Node: "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab", Resolver: nodes})

	claim, _ := a.Acquire(ctx, nil)
	fmt.Println("A holds:", claim.Key, claim.Type)

	_, err := b.Acquire(ctx, nil)
	var held *fence.HeldError
	if errors.As(err, &held) {
		fmt.Println("B refused, holder:", held.Holder, held.HolderNode)
	}

	grant := &fence.Grant{Disk: "disk-1", Node: "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab", Supersedes: []fence.Key{keyA}}
	claim, _ = b.Acquire(ctx, grant)
	fmt.Println("B took over from", claim.Preempted, "with PREEMPT AND ABORT:", claim.PreemptAndAbort)

	var lost *fence.LostError
	fmt.Println("A lost:", errors.As(a.Check(ctx), &lost))
	// Output:
	// A holds: 0x76638f635b9108ec Write Exclusive
	// B refused, holder: 0x76638f635b9108ec node-a
	// B took over from [0x76638f635b9108ec] with PREEMPT AND ABORT: false
	// A lost: true
}
