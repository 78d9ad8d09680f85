package fence

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// ReservationType is a persistent reservation type code (SPC-4
// "Persistent reservation type codes"; the TYPE field of PERSISTENT RESERVE
// OUT and of READ RESERVATION data).
type ReservationType uint8

// Reservation types (SPC-4 "Persistent reservation type codes").
const (
	WriteExclusive                 ReservationType = 0x1
	ExclusiveAccess                ReservationType = 0x3
	WriteExclusiveRegistrantsOnly  ReservationType = 0x5
	ExclusiveAccessRegistrantsOnly ReservationType = 0x6
	WriteExclusiveAllRegistrants   ReservationType = 0x7
	ExclusiveAccessAllRegistrants  ReservationType = 0x8
)

var typeNames = map[ReservationType]string{
	WriteExclusive:                 "Write Exclusive",
	ExclusiveAccess:                "Exclusive Access",
	WriteExclusiveRegistrantsOnly:  "Write Exclusive, Registrants Only",
	ExclusiveAccessRegistrantsOnly: "Exclusive Access, Registrants Only",
	WriteExclusiveAllRegistrants:   "Write Exclusive, All Registrants",
	ExclusiveAccessAllRegistrants:  "Exclusive Access, All Registrants",
}

func (t ReservationType) String() string {
	if n, ok := typeNames[t]; ok {
		return n
	}
	return fmt.Sprintf("type 0x%x", uint8(t))
}

// AllRegistrants reports whether every registrant holds a reservation of this
// type (the READ RESERVATION key field is then 0).
func (t ReservationType) AllRegistrants() bool {
	return t == WriteExclusiveAllRegistrants || t == ExclusiveAccessAllRegistrants
}

// Exclusive reports whether, under this type, an I_T nexus that registers
// but does not hold the reservation still cannot write. Only these types
// keep a disk single-writer: under the registrants-only and all-registrants
// types any node that merely registers may write.
func (t ReservationType) Exclusive() bool {
	return t == WriteExclusive || t == ExclusiveAccess
}

// MarshalText names the type in JSON output.
func (t ReservationType) MarshalText() ([]byte, error) { return []byte(t.String()), nil }

// Method is how a disk is fenced.
type Method string

const (
	// MethodPR is SCSI-3 persistent reservations, enforced by the target.
	MethodPR Method = "scsi-pr"
	// MethodLease is the on-disk lease (fence/lease), kept by the node's
	// agent and host watchdog.
	MethodLease Method = "disk-lease"
	// MethodNone means the disk offers no fencing of its own; the lease
	// implementation takes over for such disks.
	MethodNone Method = "none"
)

// Support is the answer of Probe.
type Support struct {
	Method Method `json:"method"`
	// Reason says why a disk has no PR (e.g. "not a SCSI device (virtio-blk)",
	// "target rejects PERSISTENT RESERVE IN: ILLEGAL REQUEST ...").
	Reason string `json:"reason,omitempty"`
	// Types lists the reservation types the target reports it supports; empty
	// when the target does not report them (REPORT CAPABILITIES unsupported
	// or its type mask not valid).
	Types []ReservationType `json:"types,omitempty"`
	// Preferred is the type Acquire will reserve with.
	Preferred ReservationType `json:"preferred,omitempty"`
	// PersistThroughPowerLoss: the target can keep reservations across power
	// loss (PTPL_C). We never ask for it; reported for the operator.
	PersistThroughPowerLoss bool `json:"ptpl_capable"`
}

// Grant lets a node take a disk over from a holder that the cloud says is
// gone. Only the controller issues grants (in the publish context of
// ControllerPublishVolume); a node never invents one.
type Grant struct {
	// Disk is the cloud disk the grant is for.
	Disk string `json:"disk"`
	// Node is the node the grant is for: its SMBIOS UUID (the VM's
	// reference_id).
	Node string `json:"node"`
	// Supersedes lists the fence keys of the previous attachment(s), computed
	// with KeyFromUUID from the previous VM's reference_id. Only these keys
	// may be preempted.
	Supersedes []Key `json:"supersedes"`
}

// Names reports whether the grant supersedes k.
func (g *Grant) Names(k Key) bool {
	if g == nil {
		return false
	}
	for _, s := range g.Supersedes {
		if s == k {
			return true
		}
	}
	return false
}

// ForNode checks that the grant is meant for this node and disk. An empty
// disk argument skips the disk check (an operator acting on a device path
// may not know the cloud disk id); the node must always match.
func (g *Grant) ForNode(nodeUUID, disk string) error {
	want, err := CanonicalUUID(g.Node)
	if err != nil {
		return fmt.Errorf("grant for disk %q: %w", g.Disk, err)
	}
	me, err := CanonicalUUID(nodeUUID)
	if err != nil {
		return fmt.Errorf("checking grant: this node's %w", err)
	}
	if want != me {
		return fmt.Errorf("grant for disk %q is for node %s, not this node (%s); it cannot be used here", g.Disk, want, me)
	}
	if disk != "" && g.Disk != disk {
		return fmt.Errorf("grant is for disk %q, not %q; ask the controller for a grant for this disk", g.Disk, disk)
	}
	if len(g.Supersedes) == 0 {
		return fmt.Errorf("grant for disk %q names no superseded key; nothing may be preempted with it", g.Disk)
	}
	return nil
}

// Acquired describes what a successful Acquire holds: the disk, by this
// node's key (the "claim" of docs/fencing.md).
type Acquired struct {
	Method Method          `json:"method"`
	Key    Key             `json:"key"`
	Type   ReservationType `json:"type"`
	// Preempted lists keys removed by a granted takeover.
	Preempted []Key `json:"preempted,omitempty"`
	// PreemptAndAbort is false when the takeover had to fall back to plain
	// PREEMPT because the target rejected PREEMPT AND ABORT.
	PreemptAndAbort bool `json:"preempt_and_abort,omitempty"`
	// Already is true when the disk was already held by this key.
	Already bool `json:"already,omitempty"`
}

// Fencer fences one disk for one node. The SCSI-3 PR engine implements it
// for disks whose target supports persistent reservations; the on-disk lease
// implements it for the rest.
//
// A Fencer that has observed the loss of its claim stays lost: Acquire then
// fails with a *LostError until a new Fencer is made. This is what keeps a
// preempted node from re-registering by itself (docs/architecture.md P4). The one
// exception is a Reestablisher taking back a claim that the disk itself
// forgot.
type Fencer interface {
	// Probe reports whether the disk supports this fencing method and with
	// which reservation types. It changes nothing on the disk.
	Probe(ctx context.Context) (Support, error)
	// Acquire claims the disk for this node. A disk held by another node is
	// refused with a *HeldError, unless grant names the holder's key, in
	// which case the holder is preempted. grant may be nil.
	Acquire(ctx context.Context, grant *Grant) (Acquired, error)
	// Release gives the claim up. Releasing a disk this node does not hold
	// is not an error.
	Release(ctx context.Context) error
	// Check verifies that the claim is still intact; a lost claim is a
	// *LostError.
	Check(ctx context.Context) error
}

// Reestablisher is a Fencer that can take back a claim whose loss Check
// reported because the storage forgot it (a target that keeps reservations
// in memory restarted), not because another node took it. Reestablish
// claims the disk again only when the disk shows that no other node has
// registered since; otherwise it returns a *LostError (naming the foreign
// key when there is one) and the claim stays lost. It never preempts and
// never needs a grant. Any other error leaves the claim lost as well.
type Reestablisher interface {
	Reestablish(ctx context.Context) (Acquired, error)
}

// FirstClaimer is a Fencer whose claims are kept on the disk itself (the
// on-disk lease), so that they travel with the disk's contents into a
// clone or a volume restored from a snapshot. AcquireFirst claims a disk
// that the controller says it gave to no node before: the claims found
// on it are copies from the source disk, and are set aside instead of
// being waited out, unless they show a live holder. It needs no grant.
type FirstClaimer interface {
	AcquireFirst(ctx context.Context) (Acquired, error)
}

// ReclaimWait says how a WaitingAcquirer treats a disk whose storage shows
// no claim and no sign of any claim since the storage started. That is
// what a new disk looks like, and also a disk whose storage restarted and
// forgot its holder's claim, which the holder takes back at its next check
// (Reestablisher). A blank disk is new and is claimed at once; a disk
// holding data is claimed only when no holder has re-established within
// Wait.
type ReclaimWait struct {
	// Wait is how long the holders' agents get to re-establish: longer
	// than their claim check interval, with a margin for their paths to
	// the storage to come back. Zero claims at once.
	Wait time.Duration
	// Poll is how often the disk is read during the wait, so that a
	// holder's re-established claim ends it early; zero means a second.
	Poll time.Duration
	// Contents reports what the disk holds, "" when it is blank. Without
	// it, or when it fails, the disk counts as holding data.
	Contents func(ctx context.Context) (string, error)
}

// WaitingAcquirer is a Fencer whose storage can forget claims (a target
// that keeps reservations in memory only). AcquireWaiting is Acquire for a
// stage: with a grant, or when the disk shows a claim or signs of an
// earlier one, it is Acquire; otherwise w decides, and a holder that
// re-establishes during the wait gets the disk refused with a *HeldError
// naming it. The wait ends with the context's error when ctx ends first.
type WaitingAcquirer interface {
	AcquireWaiting(ctx context.Context, grant *Grant, w ReclaimWait) (Acquired, error)
}

// ErrNotSupported is wrapped when a disk does not support the fencing method
// asked for (for the PR engine: no SCSI, or PERSISTENT RESERVE rejected).
var ErrNotSupported = errors.New("fencing method not supported by this disk")

// Resolver maps a fence key to the name of the node it belongs to, when
// known. It never has to know every key; unknown keys are reported as such.
type Resolver interface {
	NodeForKey(Key) (name string, ok bool)
}

// Directory is a Resolver built from node names and their SMBIOS UUIDs.
type Directory map[Key]string

// NewDirectory derives each node's key from its UUID. Input: node name ->
// SMBIOS UUID.
func NewDirectory(nodes map[string]string) (Directory, error) {
	d := Directory{}
	for name, uuid := range nodes {
		k, err := KeyFromUUID(uuid)
		if err != nil {
			return nil, fmt.Errorf("node %q: %w", name, err)
		}
		d[k] = name
	}
	return d, nil
}

// NodeForKey implements Resolver.
func (d Directory) NodeForKey(k Key) (string, bool) {
	n, ok := d[k]
	return n, ok
}

// HeldError refuses a disk held by another node (docs/architecture.md P2). Its text names
// the holder's key and, where known, its node, and says what may be done.
type HeldError struct {
	Device     string
	Holder     Key
	HolderNode string // empty when no resolver knows the key
	Type       ReservationType
	// Registered lists every foreign key registered on the disk, for the
	// operator; the holder is among them.
	Registered []Key
	// Granted is set when a grant was presented but did not name the holder.
	Granted bool
}

func (e *HeldError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "disk %s is held by another node: fence key %s", e.Device, e.Holder)
	if e.HolderNode != "" {
		fmt.Fprintf(&b, " (node %s)", e.HolderNode)
	} else {
		b.WriteString(" (node unknown)")
	}
	if e.Type != 0 {
		fmt.Fprintf(&b, ", type %s", e.Type)
	}
	if e.Granted {
		b.WriteString("; the takeover grant does not name this key, so it is refused")
	} else {
		b.WriteString("; refused: detach it from the other node, or have the controller issue a takeover grant")
	}
	return b.String()
}

// LostError reports that a claim this node had is gone (docs/architecture.md P4): its
// key was preempted or removed, or another node holds the reservation. The
// node must stop I/O to the disk and must not re-claim it by itself.
type LostError struct {
	Device string
	Reason string
	// Holder is the key now holding the disk, when one does.
	Holder     Key
	HolderNode string
}

func (e *LostError) Error() string {
	s := fmt.Sprintf("claim on disk %s lost: %s", e.Device, e.Reason)
	if e.Holder != 0 {
		s += fmt.Sprintf("; now held by key %s", e.Holder)
		if e.HolderNode != "" {
			s += fmt.Sprintf(" (node %s)", e.HolderNode)
		}
	}
	return s + "; stop using the disk; it is not re-claimed automatically"
}
