package kubeevents

import (
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// users starts a plugin process whose Users hands reports to a Poster
// against the rig's API server; file keeps what Users knows.
func (r *rig) users(t *testing.T, file string) (*Users, func()) {
	p, stop := r.poster(t, time.Millisecond)
	return &Users{To: p, File: file, Log: slog.New(slog.NewTextHandler(r.log, nil))}, stop
}

const (
	vol    = "ch-gen-1/42"
	serial = "42"
	target = "/var/lib/kubelet/pods/0b7c/volumes/kubernetes.io~csi/pvc-9f1e/mount"
)

var (
	claim = Object{Kind: KindClaim, Namespace: "shop", Name: "data-web-0"}
	pod   = Object{Kind: KindPod, Namespace: "shop", Name: "web-0", UID: "0b7c5e2a-3d1f-4c6e-9a8b-7f6e5d4c3b2a"}
)

func fenced(seq uint64) Report {
	return Report{AgentStarted: agentStart, Seq: seq, Time: agentStart.Add(time.Duration(seq) * time.Second),
		Reason: "DiskFenced", Type: corev1.EventTypeWarning, Volume: vol, Device: "/dev/sdb", Serial: serial,
		Message: "volume " + vol + ": the reservation on /dev/sdb was lost to key 0000000000abcdef; I/O stopped"}
}

func takeover(seq uint64) Report {
	return Report{AgentStarted: agentStart, Seq: seq, Time: agentStart.Add(time.Duration(seq) * time.Second),
		Reason: "TakeoverGranted", Type: corev1.EventTypeWarning, Volume: vol, Device: "/dev/sdb", Serial: serial, HolderKey: "0000000000abcdef",
		Message: "volume " + vol + ": /dev/sdb taken over from key 0000000000abcdef with the controller's grant"}
}

func about(r Report, o Object) Report { r.About = o; return r }

// eventsAbout lists the Events whose involvedObject has kind.
func eventsAbout(ev map[string]corev1.Event, kind string) []corev1.Event {
	var out []corev1.Event
	for _, e := range ev {
		if e.InvolvedObject.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// A report about a volume staged for a claim is an Event on the Node and
// one on the claim, in the claim's namespace, naming it by kind, name and
// uid as `kubectl describe pvc` searches for it.
func TestEventOnTheClaim(t *testing.T) {
	r := newRig(t)
	r.api.set(func(f *fakeAPI) { f.claims["shop/data-web-0"] = "5d2e8c1a-0f4b-4e2d-8a6c-1b3d5f7e9a0c" })
	u, _ := r.users(t, "")
	u.Staging(vol, serial, Object{Namespace: "shop", Name: "data-web-0"})
	u.Record(fenced(3))
	eventually(t, "the Events on the Node and the claim", func() bool { return r.res.get("created") == 2 })
	ev, reqs := r.api.snapshot()
	if len(eventsAbout(ev, "Node")) != 1 {
		t.Errorf("Events %v; want one on the Node", ev)
	}
	e, ok := ev[EventName("worker-1", about(fenced(3), claim))]
	want := corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: "shop", Name: "data-web-0",
		UID: "5d2e8c1a-0f4b-4e2d-8a6c-1b3d5f7e9a0c"}
	if !ok || e.InvolvedObject != want {
		t.Fatalf("involvedObject %+v, want %+v (Events %v)", e.InvolvedObject, want, ev)
	}
	if e.Namespace != "shop" || e.Reason != "DiskFenced" || e.Type != "Warning" || e.Count != 1 || e.Message != fenced(3).Message ||
		e.Source.Component != "vco-csi" || e.Source.Host != "worker-1" || !strings.HasPrefix(e.Name, "data-web-0.vco-") {
		t.Errorf("Event %+v", e)
	}
	if !strings.Contains(strings.Join(reqs, "\n"), "GET pvc shop/data-web-0") {
		t.Errorf("the claim's uid was not read: %v", reqs)
	}
}

// The pod a volume is published to gets the reports of the volume's stage
// (the takeover) when it is published, and those that come while it is.
func TestEventOnThePodAtPublish(t *testing.T) {
	r := newRig(t)
	r.api.set(func(f *fakeAPI) { f.claims["shop/data-web-0"] = "5d2e8c1a" })
	u, _ := r.users(t, "")
	refused := about(refusal(1), Object{})
	refused.Volume = vol
	u.Staging(vol, serial, claim)
	u.Record(refused) // a first stage refused; the retry took over
	u.Staging(vol, serial, claim)
	u.Record(takeover(2))
	eventually(t, "the refusal and the takeover on the Node and the claim", func() bool { return r.res.get("created") == 4 })
	u.Published(vol, target, pod)
	eventually(t, "the takeover on the pod", func() bool { return r.res.get("created") == 5 })
	u.Published(vol, target, pod) // the kubelet retries
	time.Sleep(50 * time.Millisecond)
	ev, _ := r.api.snapshot()
	e, ok := ev[EventName("worker-1", about(takeover(2), pod))]
	want := corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: "shop", Name: "web-0", UID: types.UID(pod.UID)}
	if !ok || e.InvolvedObject != want || e.Namespace != "shop" || e.Reason != "TakeoverGranted" || e.Count != 1 {
		t.Fatalf("the pod's Event %+v (Events %v)", e, ev)
	}
	if n := len(eventsAbout(ev, "Pod")); n != 1 {
		t.Errorf("%d Events on the pod; the refusal of the stage before is not the pod's", n)
	}
	u.Record(fenced(3))
	eventually(t, "the fence loss on the pod", func() bool {
		ev, _ := r.api.snapshot()
		_, ok := ev[EventName("worker-1", about(fenced(3), pod))]
		return ok
	})
	u.Unpublished(vol, target)
	u.Unstaged(vol)
	u.Record(fenced(4))
	eventually(t, "the second fence loss counted on the claim", func() bool {
		ev, _ := r.api.snapshot()
		return ev[EventName("worker-1", about(fenced(4), claim))].Count == 2
	})
	time.Sleep(50 * time.Millisecond)
	if ev, _ := r.api.snapshot(); ev[EventName("worker-1", about(fenced(4), pod))].Count != 1 {
		t.Errorf("a report after the unpublish reached the pod: %+v", ev[EventName("worker-1", about(fenced(4), pod))])
	}
}

// A restarted plugin receives the agent's ring again: nothing is posted
// twice on the claim or the pod, though the restarted process was told
// of neither (the kubelet stages and publishes nothing again); what
// Users knew comes from its file.
func TestNoEventTwiceOnReplay(t *testing.T) {
	r := newRig(t)
	r.api.set(func(f *fakeAPI) { f.claims["shop/data-web-0"] = "5d2e8c1a" })
	file := filepath.Join(t.TempDir(), "kube-events.json")
	u1, stop1 := r.users(t, file)
	u1.Staging(vol, serial, claim)
	u1.Record(takeover(2))
	u1.Published(vol, target, pod)
	u1.Record(fenced(3))
	eventually(t, "six Events", func() bool { return r.res.get("created") == 6 })
	stop1()
	before, _ := r.api.snapshot()

	u2, _ := r.users(t, file)
	u2.Record(takeover(2))
	u2.Record(fenced(3))
	eventually(t, "the replay reconciled", func() bool { return r.res.get("already_posted") == 6 })
	u2.Record(fenced(4))
	eventually(t, "the new fence loss on the pod", func() bool {
		ev, _ := r.api.snapshot()
		return ev[EventName("worker-1", about(fenced(4), pod))].Count == 2
	})
	ev, _ := r.api.snapshot()
	if len(ev) != len(before) || r.res.get("created") != 6 {
		t.Errorf("%d Events after the replay, %d before; created %d", len(ev), len(before), r.res.get("created"))
	}
	for name, e := range before {
		want := e.Count
		if e.Reason == "DiskFenced" {
			want++
		}
		if ev[name].Count != want {
			t.Errorf("%s about %s counts %d, want %d", e.Reason, e.InvolvedObject.Kind, ev[name].Count, want)
		}
	}
}

// Without the permission for a claim's namespace (an add-on whose RBAC is
// older than this plugin) the Node's Events are posted, none on the claim,
// and the log says once what to grant.
func TestClaimEventsDeniedByRBAC(t *testing.T) {
	r := newRig(t)
	r.api.set(func(f *fakeAPI) { f.denied["shop"] = true })
	u, _ := r.users(t, "")
	u.Staging(vol, serial, claim)
	u.Published(vol, target, pod)
	u.Record(takeover(2))
	u.Record(fenced(3))
	eventually(t, "the Node's Events", func() bool { return r.res.get("created") == 2 })
	eventually(t, "the claim's and the pod's given up", func() bool { return r.res.get("failed") == 4 })
	time.Sleep(50 * time.Millisecond)
	ev, reqs := r.api.snapshot()
	if len(ev) != 2 || len(eventsAbout(ev, "Node")) != 2 {
		t.Errorf("Events %v; want the Node's two only", ev)
	}
	if n := strings.Count(strings.Join(reqs, "\n"), "denied shop"); n != 4 {
		t.Errorf("%d requests denied; want one per Event (retrying would hold up the Node's): %v", n, reqs)
	}
	out := r.log.String()
	if strings.Count(out, "about claims and pods cannot be posted") != 1 || !strings.Contains(out, "HTTP 403") ||
		!strings.Contains(out, "ClusterRole vco-csi-node-events") {
		t.Errorf("log:\n%s", out)
	}
}

// A volume made before the controller kept its claim in the volume
// context: Events on the Node only, and none asked of the API about it.
func TestVolumeWithoutClaimOnlyOnTheNode(t *testing.T) {
	r := newRig(t)
	u, _ := r.users(t, "")
	u.Staging(vol, serial, Object{})
	u.Record(fenced(3))
	eventually(t, "the Node's Event", func() bool { return r.res.get("created") == 1 })
	time.Sleep(50 * time.Millisecond)
	ev, reqs := r.api.snapshot()
	if len(ev) != 1 || len(eventsAbout(ev, "Node")) != 1 || len(reqs) != 1 {
		t.Errorf("Events %v, requests %v; want the Node's one", ev, reqs)
	}
}

// The uevent watcher's refusal names a disk, not a volume: a disk the
// platform attached again to a node that staged it before (it missed a
// detach) is refused on the claim as well.
func TestWatcherRefusalOfADiskStagedBefore(t *testing.T) {
	r := newRig(t)
	r.api.set(func(f *fakeAPI) { f.claims["shop/data-web-0"] = "5d2e8c1a" })
	u, _ := r.users(t, "")
	u.Staging(vol, serial, claim)
	u.Unstaged(vol)
	w := refusal(5)
	w.Volume, w.Serial = "", serial
	u.Record(w)
	other := refusal(6)
	other.Volume, other.Serial, other.Device = "", "77", "/dev/sdc"
	u.Record(other)
	eventually(t, "three Events", func() bool { return r.res.get("created") == 3 })
	ev, _ := r.api.snapshot()
	if _, ok := ev[EventName("worker-1", about(w, claim))]; !ok || len(eventsAbout(ev, "PersistentVolumeClaim")) != 1 {
		t.Errorf("Events %v; want the refusal of serial 42 on the claim, that of 77 on the Node only", ev)
	}
}

// A claim deleted since its volume was staged: the Node's Event only, and
// the claim is not asked for again and again.
func TestClaimGone(t *testing.T) {
	r := newRig(t)
	u, _ := r.users(t, "")
	u.Staging(vol, serial, claim)
	u.Record(fenced(3))
	eventually(t, "the Node's Event and the claim given up", func() bool { return r.res.get("created") == 1 && r.res.get("failed") == 1 })
	time.Sleep(50 * time.Millisecond)
	if _, reqs := r.api.snapshot(); strings.Count(strings.Join(reqs, "\n"), "GET pvc") != 1 {
		t.Errorf("requests %v", reqs)
	}
	if !strings.Contains(r.log.String(), "a claim is gone") {
		t.Errorf("log:\n%s", r.log)
	}
}

// A file that cannot be written is said once; Users goes on in memory.
func TestUsersFileThatCannotBeWritten(t *testing.T) {
	r := newRig(t)
	r.api.set(func(f *fakeAPI) { f.claims["shop/data-web-0"] = "5d2e8c1a" })
	u, _ := r.users(t, filepath.Join(t.TempDir(), "no-such-dir", "kube-events.json"))
	u.Staging(vol, serial, claim)
	u.Published(vol, target, pod)
	u.Record(fenced(3))
	eventually(t, "the Events on the Node, the claim and the pod", func() bool { return r.res.get("created") == 3 })
	if n := strings.Count(r.log.String(), "cannot be kept"); n != 1 {
		t.Errorf("said %d times:\n%s", n, r.log)
	}
}

// A claim named in a PV's attributes by something other than the
// provisioner may be anything: one that is no Kubernetes object name is
// never put into an API path, and the events stay on the Node.
func TestClaimThatIsNoObjectNameOnlyOnTheNode(t *testing.T) {
	for _, c := range []Object{
		{Namespace: "..", Name: "data-web-0"},
		{Namespace: "shop", Name: "../../secrets/x"},
		{Namespace: "Shop", Name: "data-web-0"},
	} {
		r := newRig(t)
		u, _ := r.users(t, "")
		u.Staging(vol, serial, c)
		u.Record(fenced(3))
		eventually(t, "the Node's Event", func() bool { return r.res.get("created") == 1 })
		time.Sleep(50 * time.Millisecond)
		ev, reqs := r.api.snapshot()
		if len(ev) != 1 || len(eventsAbout(ev, "Node")) != 1 || len(reqs) != 1 {
			t.Errorf("claim %+v: Events %v, requests %v; want the Node's one", c, ev, reqs)
		}
	}
}
