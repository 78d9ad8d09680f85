package kubeevents

import (
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
)

const (
	// maxVolumes bounds the volumes Users remembers; those staged longest
	// ago and published to no pod are forgotten first.
	maxVolumes = 1024
	// maxRecent bounds the reports kept per volume for a pod published
	// after them.
	maxRecent = 16
)

// Users knows which claim each volume staged on this node was made for and
// which pods it is published to, and hands each report to a Recorder about
// the Node and, where it names such a volume, about its claim and pods too
// (docs/events.md, "In Kubernetes"). The node service tells it (it is a
// driver.VolumeUsers); the Follower hands it the agent's reports.
//
// A claim is remembered past the volume's unstage: a disk the platform
// attaches again to a node that had it (a detach it missed) is refused by
// the agent's uevent watcher, whose report names the disk's serial only,
// and that refusal belongs on the claim as well. With File set, what it
// knows survives a restart of the plugin (an upgrade), which the kubelet
// does not follow with new stage or publish calls.
type Users struct {
	// To receives the reports; a *Poster.
	To Recorder
	// File keeps what Users knows across restarts; empty: memory only.
	File string
	Log  *slog.Logger

	once   sync.Once
	mu     sync.Mutex
	vols   map[string]*volumeUse
	failed bool // saving to File failed; said once until it works again
}

// volumeUse is what is known of one volume; the exported fields are kept
// in File.
type volumeUse struct {
	Claim  Object            `json:"claim,omitzero"`
	Serial string            `json:"serial,omitempty"`
	Pods   map[string]Object `json:"pods,omitempty"` // by target path
	Staged time.Time         `json:"staged"`
	// recent are the reports about the volume since its last stage
	// began, refusals aside, for a pod it is published to afterwards:
	// the takeover its stage made belongs on that pod.
	recent []Report
}

func (u *Users) load() {
	u.once.Do(func() {
		if u.Log == nil {
			u.Log = slog.New(slog.DiscardHandler)
		}
		u.vols = map[string]*volumeUse{}
		if u.File == "" {
			return
		}
		b, err := os.ReadFile(u.File)
		if errors.Is(err, os.ErrNotExist) {
			return
		}
		if err == nil {
			err = json.Unmarshal(b, &u.vols)
		}
		if err != nil || u.vols == nil {
			u.vols = map[string]*volumeUse{}
			u.Log.Warn("the claims and pods of this node's volumes could not be read; the agent's events about volumes staged before are posted about the node only until they are staged again",
				"file", u.File, "err", err)
		}
	})
}

// named reports whether o names an object as Kubernetes names them (a
// DNS label for the namespace, a DNS subdomain for the name). The claim
// comes from the PV's volume attributes, which whoever writes a PV sets:
// anything else is not used in an API path, and its events go to the
// Node only.
func (u *Users) named(o Object, what string) bool {
	if o.Name == "" || o.Namespace == "" {
		return false
	}
	if len(validation.IsDNS1123Label(o.Namespace)) > 0 || len(validation.IsDNS1123Subdomain(o.Name)) > 0 {
		u.Log.Warn("the volume names a "+what+" that is no Kubernetes object name; its events are posted about the node only",
			"namespace", o.Namespace, "name", o.Name)
		return false
	}
	return true
}

// saveLocked writes what is known to File, atomically.
func (u *Users) saveLocked() {
	if u.File == "" {
		return
	}
	b, err := json.Marshal(u.vols)
	if err == nil {
		tmp := u.File + ".tmp"
		if err = os.WriteFile(tmp, b, 0o600); err == nil {
			err = os.Rename(tmp, u.File)
		}
	}
	switch {
	case err != nil && !u.failed:
		u.failed = true
		u.Log.Warn("the claims and pods of this node's volumes cannot be kept; after a restart of the plugin the agent's events about them are posted about the node only",
			"file", u.File, "dir", filepath.Dir(u.File), "err", err)
	case err == nil:
		u.failed = false
	}
}

// Staging says that volumeID, a disk of serial, made for claim, is being
// staged; it is called before the agent is asked, so that a refusal of the
// stage is shown on the claim. A claim without a name (a volume made
// before the controller passed it on) is not remembered.
func (u *Users) Staging(volumeID, serial string, claim Object) {
	u.load()
	if !u.named(claim, "claim") {
		return
	}
	claim.Kind, claim.UID = KindClaim, ""
	u.mu.Lock()
	defer u.mu.Unlock()
	v := u.vols[volumeID]
	if v == nil {
		u.evictLocked()
		v = &volumeUse{}
		u.vols[volumeID] = v
	}
	changed := v.Claim != claim || v.Serial != serial
	v.Claim, v.Serial, v.recent = claim, serial, nil
	v.Staged = time.Now().UTC().Truncate(time.Second)
	if changed {
		u.saveLocked()
	}
}

// Published says that volumeID is published to pod at targetPath. The
// reports of the volume's stage (a takeover) are shown on the pod now.
func (u *Users) Published(volumeID, targetPath string, pod Object) {
	u.load()
	if !u.named(pod, "pod") {
		return
	}
	pod.Kind = KindPod
	u.mu.Lock()
	v := u.vols[volumeID]
	if v == nil {
		u.evictLocked()
		v = &volumeUse{Staged: time.Now().UTC().Truncate(time.Second)}
		u.vols[volumeID] = v
	}
	if v.Pods == nil {
		v.Pods = map[string]Object{}
	}
	changed := v.Pods[targetPath] != pod
	v.Pods[targetPath] = pod
	var recent []Report
	if changed {
		// A repeated publish (the kubelet retries) hands on nothing
		// twice.
		recent = append(recent, v.recent...)
		u.saveLocked()
	}
	u.mu.Unlock()
	if u.To == nil {
		return
	}
	for _, r := range recent {
		r.About = pod
		u.To.Record(r)
	}
}

// Unpublished says that volumeID is no longer published at targetPath.
func (u *Users) Unpublished(volumeID, targetPath string) {
	u.load()
	u.mu.Lock()
	defer u.mu.Unlock()
	v := u.vols[volumeID]
	if v == nil {
		return
	}
	if _, ok := v.Pods[targetPath]; !ok {
		return
	}
	delete(v.Pods, targetPath)
	if v.Claim.Name == "" && len(v.Pods) == 0 {
		delete(u.vols, volumeID)
	}
	u.saveLocked()
}

// Unstaged says that volumeID left this node; its claim is remembered.
func (u *Users) Unstaged(volumeID string) {
	u.load()
	u.mu.Lock()
	defer u.mu.Unlock()
	if v := u.vols[volumeID]; v != nil {
		v.recent = nil
	}
}

// evictLocked makes room for one more volume.
func (u *Users) evictLocked() {
	if len(u.vols) < maxVolumes {
		return
	}
	var old string
	for id, v := range u.vols {
		if len(v.Pods) == 0 && (old == "" || v.Staged.Before(u.vols[old].Staged)) {
			old = id
		}
	}
	if old != "" {
		delete(u.vols, old)
	}
}

// Record hands r on about the Node, and about the claim and the pods of
// the volume it names (by id, or by the disk's serial for a refusal by
// the uevent watcher).
func (u *Users) Record(r Report) {
	u.load()
	if u.To == nil {
		return
	}
	u.To.Record(r)
	u.mu.Lock()
	var v *volumeUse
	if r.Volume != "" {
		v = u.vols[r.Volume]
	} else if r.Serial != "" {
		for _, c := range u.vols {
			if c.Serial == r.Serial && c.Claim.Name != "" && (v == nil || c.Staged.After(v.Staged)) {
				v = c
			}
		}
	}
	var about []Object
	if v != nil {
		if v.Claim.Name != "" {
			about = append(about, v.Claim)
		}
		if r.Volume != "" {
			for _, p := range v.Pods {
				about = append(about, p)
			}
			if r.Reason != "DiskRefused" {
				v.recent = append(v.recent, r)
				if len(v.recent) > maxRecent {
					v.recent = v.recent[len(v.recent)-maxRecent:]
				}
			}
		}
	}
	u.mu.Unlock()
	for _, o := range about {
		r.About = o
		u.To.Record(r)
	}
}
