package volume

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
	"github.com/whitesky-cloud/vco-storage/internal/safety/inuse"
)

// host is every effect the manager has on the node besides its claim
// records, its fencers (FencerFactory), dm-crypt (Encryption) and the
// data mapping (Manager.mapData): the disk's read-only flag and flushes,
// what a device holds (the blank proofs), mkfs and fsck, mounts, the stop
// of a lost claim's I/O, and the release guard's proof that nothing of a
// volume is in use. osHost is the manager's; the manager simulation
// (sim_test.go) runs the same manager code over a modelled node.
type host interface {
	mounter
	ReadOnly(dev *Device) (bool, error)
	SetReadOnly(dev *Device, ro bool) error
	// Flush writes the disk's page cache down and flushes its write cache.
	Flush(dev *Device) error
	// FlushPath flushes the block device at p; one that is not there (or a
	// detached loop device) holds nothing to flush.
	FlushPath(p string) error
	Size(path string) (int64, error)
	ReadHead(ctx context.Context, path string, n int64) ([]byte, error)
	Prove(ctx context.Context, path string) (blank.Proof, error)
	ProveFormatLeftovers(ctx context.Context, path, fsType, uuid string) (blank.Proof, error)
	ProveEncrypted(ctx context.Context, path string) (blank.Proof, error)
	ProvePast(ctx context.Context, path string, from int64) (blank.Proof, error)
	MkfsInstalled(fsType, device string) error
	MakeFS(ctx context.Context, p blank.Proof, fsType string, onMapping bool, uuid string) error
	// Fsck runs fsck -a on device: its output and exec's error.
	Fsck(ctx context.Context, device string) ([]byte, error)
	// Short says how much of device the filesystem on it leaves unused.
	Short(device, fsType string) (int64, fsExtent, error)
	Resize(device, mountPath string) error
	// StopFilesystem stops writes to the filesystem mounted at p
	// (loss.go); Drain shows a lost claim's devices quiet (drain.go).
	StopFilesystem(p, device string) error
	Drain(c *Claim, disk *Device) error
	// DataMapping finds a data mapping over disk (a loop device at the
	// lease's data offset).
	DataMapping(disk string) (string, bool)
	// BlockTargetHolds checks that a raw block volume's target is the
	// bind mount of c's device node (blockTargetHolds).
	BlockTargetHolds(target string, c *Claim) error
	// MappingOpen reports whether the dm-crypt mapping at p (as a claim
	// records it) is set up.
	MappingOpen(p string) bool
	// MapsDisk reports whether the device p is a loop device whose
	// backing file is the disk node disk (removed since, or not): a
	// record's data mapping is detached only then.
	MapsDisk(p, disk string) bool
	// MapsDiskNow reports whether p is a loop device over the disk at
	// node disk as it is now: one attached over a disk removed since
	// maps nothing that is attached, even when the disk came back at the
	// same node (a new block device, which the kernel gives the node and
	// the device number the one that left had).
	MapsDiskNow(p, disk string) bool
	// PodDeviceOver reports whether the device p is a loop device bound
	// to the data mapping at node mapping (poddev.go); an error when that
	// could not be read.
	PodDeviceOver(p, mapping string) (bool, error)
	// InUse is the release guard's proof (guard.go): nil only when
	// nothing of this node uses the volume's devices or paths.
	InUse(u usage) error
	// Bind publishes: a bind mount of the staging path (of the device node
	// onto a file for a raw block volume) at target (publish.go).
	Bind(source, target string, block bool, opts []string) error
	// Unbind unmounts the publication at target; it reports whether a
	// mount was there.
	Unbind(target string) (bool, error)
	// Detach lazily detaches the mount at p (a vanished disk's).
	Detach(p string) error
	// MountRoot reports whether the target path p, opened as f, is a
	// mount root.
	MountRoot(f *os.File, p string) (bool, error)
}

// osHost is the host the agent runs on.
type osHost struct {
	mounter // beneathMounter; tests put stand-ins in its place (withMounter)
	root    string
	sysfs   string
	dev     string // where device nodes are (/dev)
	exec    utilexec.Interface
}

func (osHost) ReadOnly(dev *Device) (bool, error)     { return readOnly(dev.File) }
func (osHost) SetReadOnly(dev *Device, ro bool) error { return setReadOnly(dev.File, ro) }
func (osHost) Flush(dev *Device) error                { return flushDevice(dev.File) }
func (osHost) FlushPath(p string) error               { return flushPath(p) }
func (osHost) Size(path string) (int64, error)        { return deviceSize(path) }
func (osHost) ReadHead(ctx context.Context, path string, n int64) ([]byte, error) {
	return blank.ReadHead(ctx, path, n)
}
func (osHost) Prove(ctx context.Context, path string) (blank.Proof, error) {
	return blank.Prove(ctx, path)
}
func (osHost) ProveFormatLeftovers(ctx context.Context, path, fsType, uuid string) (blank.Proof, error) {
	return blank.ProveFormatLeftovers(ctx, path, fsType, uuid)
}
func (osHost) ProveEncrypted(ctx context.Context, path string) (blank.Proof, error) {
	return blank.ProveEncrypted(ctx, path)
}
func (osHost) ProvePast(ctx context.Context, path string, from int64) (blank.Proof, error) {
	return blank.ProvePast(ctx, path, from)
}
func (osHost) MkfsInstalled(fsType, device string) error { return mkfsInstalled(fsType, device) }
func (osHost) MakeFS(ctx context.Context, p blank.Proof, fsType string, onMapping bool, uuid string) error {
	return makeFS(ctx, p, fsType, onMapping, uuid)
}
func (osHost) Fsck(ctx context.Context, device string) ([]byte, error) {
	return exec.CommandContext(ctx, "fsck", "-a", device).CombinedOutput()
}
func (osHost) Short(device, fsType string) (int64, fsExtent, error) { return shortOf(device, fsType) }
func (h osHost) Resize(device, mountPath string) error {
	_, err := mount.NewResizeFs(h.exec).Resize(device, mountPath)
	return err
}
func (h osHost) StopFilesystem(p, device string) error { return stopFilesystem(h.root, p, device) }
func (h osHost) Drain(c *Claim, disk *Device) error {
	v, err := h.verifiedLayers(c)
	if err != nil {
		return err
	}
	return drainData(h.sysfs, v, disk.File)
}
func (h osHost) Bind(source, target string, block bool, opts []string) error {
	return bindBeneath(h.root, source, target, block, opts)
}
func (h osHost) Unbind(target string) (bool, error) { return unmountBeneath(h.root, target, 0) }
func (h osHost) Detach(p string) error {
	_, err := unmountBeneath(h.root, p, unix.MNT_DETACH)
	return err
}
func (osHost) MountRoot(f *os.File, _ string) (bool, error) {
	return isMountRoot(f)
}

func (h osHost) DataMapping(disk string) (string, bool) {
	p, err := lease.FindData(h.sysfs, disk)
	return p, err == nil && p != ""
}

func (h osHost) BlockTargetHolds(target string, c *Claim) error {
	return blockTargetHolds(h.root, target, c)
}

func (h osHost) MappingOpen(p string) bool {
	name, ok := strings.CutPrefix(p, "/dev/mapper/")
	if !ok {
		// Not a device-mapper node: the stand-in of the tests of a host
		// without device-mapper (a loop device), set up while it is a
		// block device.
		var st unix.Stat_t
		return p != "" && unix.Stat(p, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK
	}
	dms, _ := filepath.Glob(filepath.Join(h.sysfs, "block", "dm-*", "dm", "name"))
	for _, f := range dms {
		if b, err := os.ReadFile(f); err == nil && strings.TrimSpace(string(b)) == name {
			return true
		}
	}
	return false
}

func (h osHost) MapsDisk(p, disk string) bool {
	back, _, ok := h.loopBacking(p)
	return ok && disk != "" && back == disk
}

func (h osHost) MapsDiskNow(p, disk string) bool {
	back, deleted, ok := h.loopBacking(p)
	return ok && !deleted && disk != "" && back == disk
}

// loopBacking reads the backing file of the loop device p (one under the
// host's device directory), and whether the kernel says it was deleted
// since the loop device was attached: a device node goes when its device
// is removed, and a device added again gets a new node.
func (h osHost) loopBacking(p string) (back string, deleted, ok bool) {
	name := filepath.Base(p)
	if !strings.HasPrefix(name, "loop") || filepath.Dir(p) != filepath.Clean(h.dev) {
		return "", false, false
	}
	b, err := os.ReadFile(filepath.Join(h.sysfs, "block", name, "loop", "backing_file"))
	if err != nil {
		return "", false, false
	}
	back, deleted = strings.CutSuffix(strings.TrimSpace(string(b)), " (deleted)")
	return back, deleted, true
}

// InUse proves that nothing of this node uses the volume: none of its
// paths is a mount point, its dm-crypt mapping is not open, and nothing
// maps, holds or mounts its disk (package inuse).
func (h osHost) InUse(u usage) error {
	for _, p := range u.Paths {
		f, err := openBeneath(h.root, p, unix.O_PATH)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("%s could not be looked at: %w", p, err)
		}
		mp, err := isMountRoot(f)
		f.Close()
		if err != nil {
			return err
		}
		if mp {
			return &inuse.Error{Device: u.Disk, What: "it is mounted at " + p}
		}
	}
	if u.Mapper != "" {
		p := filepath.Join("/dev/mapper", u.Mapper)
		if _, err := os.Lstat(p); err == nil {
			return &inuse.Error{Device: u.Disk, What: "its dm-crypt mapping " + p + " is open"}
		}
	}
	return inuse.Disk(h.sysfs, u.Disk)
}

// verifiedLayers is c with the loop devices it names checked before a
// drain touches them: a name the kernel gave to another device since (a
// pod detached its own pod device, a reboot) is no way to this disk, and
// setting it read-only would stop another volume. A data mapping name
// that is another device's now is replaced by the mapping over the disk,
// if any; a pod device that is not over the data mapping is left out. A
// name that is gone stays, so that the drain fails on it and the stop is
// not counted done: what maps the disk then is not known.
func (h osHost) verifiedLayers(c *Claim) (*Claim, error) {
	v := *c
	if v.DataDevice != "" && exists(v.DataDevice) && !h.MapsDisk(v.DataDevice, v.Device) {
		d, err := lease.FindData(h.sysfs, v.Device)
		if err != nil {
			return nil, fmt.Errorf("the recorded data mapping %s is another device's now, and the mapping over %s cannot be found: %w", v.DataDevice, v.Device, err)
		}
		v.DataDevice, v.PodDevice = d, ""
	}
	if v.PodDevice != "" && v.DataDevice != "" && exists(v.PodDevice) {
		ok, err := h.PodDeviceOver(v.PodDevice, v.DataDevice)
		if err != nil {
			return nil, fmt.Errorf("telling whether the recorded pod device %s is over the data mapping %s: %w", v.PodDevice, v.DataDevice, err)
		}
		if !ok {
			v.PodDevice = ""
		}
	}
	return &v, nil
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
