// Package events is the agent's one event bus. Everything that matters to an
// operator about a disk (claimed, refused, fenced, released, taken over) is
// published here once and fanned out to the sinks (the journal, D-Bus
// signals) and to API subscribers, and the most recent events are kept in a
// bounded ring for status and replay.
//
// Events carry identifiers and human-readable reasons only; there is no
// field for key material, passphrases or tokens, and callers must not put
// such values into Message or Reason.
package events

import (
	"fmt"
	"time"
)

// Type says what happened. The numeric values match the API's EventType.
type Type int

const (
	AgentStarted Type = iota + 1
	AgentStopping
	DiskClaimed
	DiskRefused
	DiskFenced
	DiskReleased
	TakeoverGranted
)

// Types lists every event type, in numeric order.
var Types = []Type{AgentStarted, AgentStopping, DiskClaimed, DiskRefused, DiskFenced, DiskReleased, TakeoverGranted}

var typeInfo = map[Type]struct {
	name string
	// messageID is the journal MESSAGE_ID: fixed forever per type so that
	// `journalctl MESSAGE_ID=...` finds every such event across versions.
	messageID string
}{
	AgentStarted:    {"AgentStarted", "629e5f31feb4e51d950ea18f50c43f0d"},
	AgentStopping:   {"AgentStopping", "30b44d829e5cfb6cb8eddb41ad66871f"},
	DiskClaimed:     {"DiskClaimed", "55cbe5282776a00e5e7fb22e9783a7f7"},
	DiskRefused:     {"DiskRefused", "4aa8a0fc1a4a92cec915055d97daeec3"},
	DiskFenced:      {"DiskFenced", "f43bb8ebcd3cedccd5bf91a8aa8e4939"},
	DiskReleased:    {"DiskReleased", "b587824732fc7a764e716a36be2c809b"},
	TakeoverGranted: {"TakeoverGranted", "f90f5c64ea8bc044fd8f178104723c26"},
}

// String is the event type's name, also the D-Bus signal name.
func (t Type) String() string {
	if i, ok := typeInfo[t]; ok {
		return i.name
	}
	return fmt.Sprintf("EventType(%d)", int(t))
}

// MessageID is the journal MESSAGE_ID of this event type.
func (t Type) MessageID() string { return typeInfo[t].messageID }

// Valid reports whether t is a known type.
func (t Type) Valid() bool { _, ok := typeInfo[t]; return ok }

// ParseType turns a name from String back into a Type.
func ParseType(name string) (Type, bool) {
	for t, i := range typeInfo {
		if i.name == name {
			return t, true
		}
	}
	return 0, false
}

// Event is one thing that happened. Zero-valued fields are "not applicable".
type Event struct {
	Type Type
	// Seq is assigned by the bus: 1 for the first event of this process.
	Seq  uint64
	Time time.Time
	// Volume is the CSI volume ID.
	Volume string
	// Device is the block device path, e.g. /dev/sdb.
	Device string
	// Serial is the disk's serial or WWN as the device reports it.
	Serial string
	// HolderKey is the fence key of the current holder (never 0 when set).
	HolderKey uint64
	// HolderNode names the node holding the disk, where known.
	HolderNode string
	// Reason is a short machine-friendly cause, e.g. "reservation-lost".
	Reason string
	// Message is the sentence an operator reads.
	Message string
	// MissedBefore is set only on a subscriber's copy: how many events that
	// subscriber missed right before this one because its buffer was full.
	MissedBefore uint64
}

// HolderKeyString is HolderKey as 16 hex digits, or "" when unset.
func (e Event) HolderKeyString() string {
	if e.HolderKey == 0 {
		return ""
	}
	return fmt.Sprintf("%016x", e.HolderKey)
}

// Text is a one-line summary used where a sink has only free text.
func (e Event) Text() string {
	s := e.Type.String()
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}
