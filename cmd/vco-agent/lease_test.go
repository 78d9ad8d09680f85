package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/fence/uevent"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// leaseLoop attaches a loop device to a sparse image (in memory where
// possible), optionally made by prepare first.
func leaseLoop(t *testing.T, prepare func(img string)) string {
	t.Helper()
	hosttest.NeedRoot(t, "needs root to attach a loop device")
	dir := t.TempDir()
	if d, err := os.MkdirTemp("/dev/shm", "lease-cli-"); err == nil {
		dir = d
		t.Cleanup(func() { os.RemoveAll(d) })
	}
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	if prepare != nil {
		prepare(img)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return dev
}

var fastLease = []string{"--io-timeout", "100ms", "--renew", "200ms", "--fail", "800ms", "--watchdog", "0s"}

func runLeaseCLI(t *testing.T, interrupt chan os.Signal, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := leaseMain(append(args, fastLease...), &out, &errb, interrupt)
	return code, out.String(), errb.String()
}

func TestLeaseCommands(t *testing.T) {
	dev := leaseLoop(t, nil)
	keyA, _ := fence.KeyFromUUID(cliUUIDA)
	names := []string{"--node", "node-a=" + cliUUIDA, "--node", "node-b=" + cliUUIDB}

	if code, _, errs := runLeaseCLI(t, nil, "acquire", dev, "--uuid", cliUUIDA); code != 1 || !strings.Contains(errs, "no lease area") {
		t.Fatalf("acquire before format: %d %q", code, errs)
	}
	if code, out, errs := runLeaseCLI(t, nil, "format", dev, "--uuid", cliUUIDA); code != 0 || !strings.Contains(out, "data starts at byte 1048576") {
		t.Fatalf("format: %d %q %q", code, out, errs)
	}
	if code, out, _ := runLeaseCLI(t, nil, "format", dev, "--uuid", cliUUIDA); code != 0 || !strings.Contains(out, "nothing written") {
		t.Fatalf("second format: %d %q", code, out)
	}

	// Node A holds the disk in the background.
	a := holdAsNodeA(t, dev)

	code, _, errs := runLeaseCLI(t, nil, append([]string{"acquire", dev, "--uuid", cliUUIDB}, names...)...)
	if code != 1 || !strings.Contains(errs, keyA.String()) || !strings.Contains(errs, "node-a") {
		t.Fatalf("acquire by B while A holds: %d %q", code, errs)
	}
	if code, _, errs := runLeaseCLI(t, nil, "check", dev, "--uuid", cliUUIDB); code != 1 || !strings.Contains(errs, keyA.String()) {
		t.Fatalf("check by B: %d %q", code, errs)
	}
	if code, out, errs := runLeaseCLI(t, nil, "check", dev, "--uuid", cliUUIDA); code != 0 {
		t.Fatalf("check by A: %d %q %q", code, out, errs)
	}
	leaseShowNamesTheOwner(t, dev, keyA)

	a.release()
	if a.code != 0 || !strings.Contains(a.out.String(), "released") {
		t.Fatalf("node A after interrupt: %d %q %q", a.code, a.out.String(), a.errb.String())
	}
	if code, out, errs := runLeaseCLI(t, nil, "acquire", dev, "--uuid", cliUUIDB, "--hold-for", "100ms"); code != 0 || !strings.Contains(out, "claimed") {
		t.Fatalf("acquire by B after release: %d %q %q", code, out, errs)
	}
}

// backgroundHolder is lease acquire by node A, holding dev until release.
type backgroundHolder struct {
	interrupt chan os.Signal
	wg        sync.WaitGroup
	code      int
	out, errb bytes.Buffer
}

// holdAsNodeA starts lease acquire of dev as node A (named node-a) and
// waits until it holds the lease.
func holdAsNodeA(t *testing.T, dev string) *backgroundHolder {
	t.Helper()
	h := &backgroundHolder{interrupt: make(chan os.Signal, 1)}
	claimed := make(chan struct{})
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		h.code = leaseMainWith(append([]string{"acquire", dev, "--uuid", cliUUIDA, "--name", "node-a"}, fastLease...), &h.out, &h.errb, h.interrupt, leaseHooks{ready: func() { close(claimed) }})
	}()
	select {
	case <-claimed:
	case <-time.After(10 * time.Second):
		t.Fatalf("node A did not claim: %s %s", h.out.String(), h.errb.String())
	}
	return h
}

// release interrupts the holder and waits for it to exit.
func (h *backgroundHolder) release() {
	h.interrupt <- os.Interrupt
	h.wg.Wait()
}

// leaseShowNamesTheOwner: lease show, as JSON and as text, names node A
// (keyA) as the owner holding the lease, and the text gives the bounds a
// taker meets from the holder's timing.
func leaseShowNamesTheOwner(t *testing.T, dev string, keyA fence.Key) {
	t.Helper()
	code, out, _ := runLeaseCLI(t, nil, "show", dev, "--uuid", cliUUIDB, "--json")
	var show struct {
		OK     bool
		Status struct {
			Owner *struct {
				Key   fence.Key
				State string
				Node  string
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &show); err != nil || code != 0 || show.Status.Owner == nil ||
		show.Status.Owner.Key != keyA || show.Status.Owner.State != "held" || show.Status.Owner.Node != "node-a" {
		t.Fatalf("show: %d %q %v", code, out, err)
	}
	code, out, _ = runLeaseCLI(t, nil, "show", dev, "--uuid", cliUUIDB)
	if code != 0 || !strings.Contains(out, "owner:      key "+keyA.String()+" (node node-a)") {
		t.Fatalf("show text: %d %q", code, out)
	}
	// The bounds a taker meets, from the holder's timing (fastLease).
	holder := lease.Timing{IOTimeout: 100 * time.Millisecond, Renew: 200 * time.Millisecond, Fail: 800 * time.Millisecond}
	for _, want := range []string{"with the owner's timing d=100ms R=200ms F=800ms W=0s",
		"Expiry + Settle = max(F+W+d, R+6d) + 2d = " + holder.Bounds().DeadTakeover.String(),
		"max(2d, R) + d/2 = " + holder.Bounds().GrantLive.String()} {
		if !strings.Contains(out, want) {
			t.Fatalf("show text lacks %q:\n%s", want, out)
		}
	}
}

func TestLeaseFormatRefusesData(t *testing.T) {
	dev := leaseLoop(t, func(img string) {
		if out, err := exec.Command("mkfs.ext4", "-q", "-F", img).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.ext4: %v %s", err, out)
		}
	})
	code, _, errs := runLeaseCLI(t, nil, "format", dev, "--uuid", cliUUIDA)
	if code != 1 || !strings.Contains(errs, "ext2/3/4 superblock") || !strings.Contains(errs, "not formatted") {
		t.Fatalf("format over ext4: %d %q", code, errs)
	}
}

// syncBuffer is a bytes.Buffer safe for the watcher's goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// lease watch refuses a loop device whose lease another node holds the
// moment its contents appear (the kernel's change event), and says so.
func TestLeaseWatch(t *testing.T) {
	img := heldByNodeA(t)

	// The second device is picked before it exists, so the watcher can be
	// told to look at it alone.
	out, err := exec.Command("losetup", "--find").Output()
	if err != nil {
		t.Fatal(err)
	}
	dev := strings.TrimSpace(string(out))
	stopW := make(chan os.Signal, 1)
	listening := make(chan struct{})
	var wout syncBuffer
	var werr bytes.Buffer
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(1)
	go func() {
		defer wg.Done()
		leaseMainWith(append([]string{"watch", "--uuid", cliUUIDB, "--node", "node-a=" + cliUUIDA}, fastLease...), &wout, &werr, stopW,
			leaseHooks{ready: func() { close(listening) }, match: func(ev uevent.Event) bool { return ev.Disk() && "/dev/"+ev.DevName == dev }})
	}()
	<-listening
	if out, err := exec.Command("losetup", dev, img).CombinedOutput(); err != nil {
		stopW <- os.Interrupt
		t.Skipf("losetup %s (taken by a neighbour meanwhile?): %v %s", dev, err, out)
	}
	t.Cleanup(func() {
		exec.Command("blockdev", "--setrw", dev).Run()
		exec.Command("losetup", "-d", dev).Run()
	})
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(wout.String(), "refused "+dev) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	stopW <- os.Interrupt
	line := wout.String()
	if !strings.Contains(line, "refused "+dev) || !strings.Contains(line, "node node-a") || !strings.Contains(line, "read-only set") {
		t.Fatalf("watch output: %q %q", line, werr.String())
	}
	if ro, err := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/ro"); err != nil || strings.TrimSpace(string(ro)) != "1" {
		t.Fatalf("refused device not read-only: %q %v", ro, err)
	}
}

// lease watch started while a disk that another node holds is already
// attached (the reported case: B's watch started after the disk was
// there) refuses it before it says it is watching, and B's raw write
// fails.
func TestLeaseWatchRefusesDiskPresentAtStart(t *testing.T) {
	img := heldByNodeA(t)

	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		exec.Command("blockdev", "--setrw", dev).Run()
		exec.Command("losetup", "-d", dev).Run()
	})
	stopW := make(chan os.Signal, 1)
	atReady := make(chan string, 1)
	var wout syncBuffer
	var werr bytes.Buffer
	done := make(chan int, 1)
	go func() {
		done <- leaseMainWith(append([]string{"watch", "--uuid", cliUUIDB, "--node", "node-a=" + cliUUIDA}, fastLease...), &wout, &werr, stopW,
			leaseHooks{ready: func() {
				ro, _ := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/ro")
				atReady <- strings.TrimSpace(string(ro))
			}, match: func(ev uevent.Event) bool { return ev.Disk() && "/dev/"+ev.DevName == dev }})
	}()
	var ro string
	select {
	case ro = <-atReady:
	case code := <-done:
		t.Fatalf("watch exited %d: %s %s", code, wout.String(), werr.String())
	case <-time.After(10 * time.Second):
		t.Fatal("watch did not start")
	}
	stopW <- os.Interrupt
	if code := <-done; code != 0 {
		t.Fatalf("watch exited %d: %s", code, werr.String())
	}
	line := wout.String()
	if ro != "1" || !strings.Contains(line, "refused "+dev) || !strings.Contains(line, "node node-a") || !strings.Contains(line, "start-up scan") {
		t.Fatalf("when watch was ready: ro=%q, output %q %q", ro, line, werr.String())
	}
	if strings.Index(line, "refused "+dev) > strings.Index(line, "watching for disks") {
		t.Fatalf("watch said it was watching before it had decided the disk present at start: %q", line)
	}
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteAt([]byte("node-b's write"), 2<<20)
		f.Close()
	}
	if err == nil {
		t.Fatal("a raw write to the refused disk succeeded")
	}
}

// heldByNodeA formats a lease loop device and has node-a hold it with
// `lease acquire` until the test ends; it returns the device's backing
// image.
func heldByNodeA(t *testing.T) (img string) {
	t.Helper()
	holder := leaseLoop(t, func(p string) { img = p })
	if code, _, errs := runLeaseCLI(t, nil, "format", holder, "--uuid", cliUUIDA); code != 0 {
		t.Fatal(errs)
	}
	stopA := make(chan os.Signal, 1)
	claimed := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var o, e bytes.Buffer
		leaseMainWith(append([]string{"acquire", holder, "--uuid", cliUUIDA, "--name", "node-a"}, fastLease...), &o, &e, stopA, leaseHooks{ready: func() { close(claimed) }})
	}()
	t.Cleanup(func() { stopA <- os.Interrupt; wg.Wait() })
	<-claimed
	return img
}

// A holder superseded by a grant marks its slot fenced before `lease
// acquire` exits with 3: the taker proceeds on that mark, and a command
// that exited before writing it left the taker waiting for the expiry
// bound (seen in the lab: 56.5 s with the default timing).
func TestLeaseHolderMarksItsSlotFencedBeforeExiting(t *testing.T) {
	dev := leaseLoop(t, nil)
	keyA, _ := fence.KeyFromUUID(cliUUIDA)
	if code, out, errs := runLeaseCLI(t, nil, "format", dev, "--uuid", cliUUIDA); code != 0 {
		t.Fatalf("format: %d %q %q", code, out, errs)
	}
	claimed := make(chan struct{})
	doneA := make(chan int, 1)
	var outA, errA bytes.Buffer
	go func() {
		doneA <- leaseMainWith(append([]string{"acquire", dev, "--uuid", cliUUIDA, "--name", "node-a"}, fastLease...), &outA, &errA, make(chan os.Signal), leaseHooks{ready: func() { close(claimed) }})
	}()
	select {
	case <-claimed:
	case <-time.After(10 * time.Second):
		t.Fatalf("node A did not claim: %s %s", outA.String(), errA.String())
	}
	grant := `{"disk":"d1","node":"` + cliUUIDB + `","supersedes":["` + keyA.String() + `"]}`
	doneB := make(chan string, 1)
	go func() {
		code, out, errs := runLeaseCLI(t, nil, "acquire", dev, "--uuid", cliUUIDB, "--disk", "d1", "--grant", grant, "--hold-for", "2s")
		doneB <- fmt.Sprintf("%d %s %s", code, out, errs)
	}()
	select {
	case code := <-doneA:
		if code != 3 {
			t.Fatalf("node A exited %d after the takeover, want 3: %s %s", code, outA.String(), errA.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("node A did not see the takeover")
	}
	// At once, as A exits: its slot says fenced.
	d, err := lease.OpenDeviceReadOnly(dev)
	if err != nil {
		t.Fatal(err)
	}
	st, _, err := lease.ReadStatus(context.Background(), d, keyA, time.Second)
	d.Close()
	if err != nil {
		t.Fatal(err)
	}
	var a *lease.SlotInfo
	for i := range st.Slots {
		if st.Slots[i].Key == keyA {
			a = &st.Slots[i]
		}
	}
	if a == nil || a.State != lease.StateFenced {
		t.Fatalf("A's slot when A exited: %+v, want fenced", a)
	}
	if r := <-doneB; !strings.HasPrefix(r, "0 ") || !strings.Contains(r, "took over") {
		t.Fatalf("B's granted takeover: %s", r)
	}
}
