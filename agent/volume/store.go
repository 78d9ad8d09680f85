package volume

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
)

// Phase is how far a stage got.
type Phase string

const (
	// PhaseClaiming: recorded before the fence is taken; nothing is
	// mounted yet.
	PhaseClaiming Phase = "claiming"
	// PhaseStaged: fenced, opened, formatted when needed, and mounted.
	PhaseStaged Phase = "staged"
	// PhaseInterrupted: the agent found the stage cut short at start and
	// undid the partial steps; the retried stage carries on from here.
	PhaseInterrupted Phase = "interrupted"
	// PhaseUnstaging: recorded before an unstage releases the fence, so
	// that an agent restarted before the record is gone knows the missing
	// registration was its own release, not a loss to another node.
	PhaseUnstaging Phase = "unstaging"
)

// State is the claim's fence state.
type State string

const (
	StateHeld     State = "held"
	StateUnfenced State = "unfenced"
	StateLost     State = "lost"
)

// Locator is how a claim's disk is found again: a cloud disk by its
// discovery locator, or a loop device by its backing file. In a record
// the disk is discovery's text form ("pci=…,serial=…"); a record whose
// locator does not parse is damaged.
type Locator struct {
	Disk        discovery.Locator `json:"disk,omitzero"`
	BackingFile string            `json:"loop_backing_file,omitempty"`
}

// IsZero reports whether l names no device.
func (l Locator) IsZero() bool { return l.Disk.IsZero() && l.BackingFile == "" }

// Equal reports whether l and o name the same device the same way.
func (l Locator) Equal(o Locator) bool { return l.Disk.Equal(o.Disk) && l.BackingFile == o.BackingFile }

func (l Locator) String() string {
	if l.BackingFile != "" {
		if !l.Disk.IsZero() {
			return l.Disk.String() + ",loop=" + l.BackingFile
		}
		return "loop=" + l.BackingFile
	}
	return l.Disk.String()
}

// Claim is the record of one staged (or being staged) volume. It holds no
// secret: the passphrase of an encrypted volume is never stored.
type Claim struct {
	Volume      string   `json:"volume"`
	Locator     Locator  `json:"locator"`
	Device      string   `json:"device"`
	DevNum      string   `json:"devnum"`
	Serial      string   `json:"serial,omitempty"`
	StagingPath string   `json:"staging_path"`
	FsType      string   `json:"fs_type,omitempty"`
	Block       bool     `json:"block,omitempty"`
	MountFlags  []string `json:"mount_flags,omitempty"`
	ReadOnly    bool     `json:"read_only,omitempty"`
	Encrypted   bool     `json:"encrypted,omitempty"`
	Mapper      string   `json:"mapper,omitempty"`
	// DataOffset and DataDevice: the fencing keeps metadata before
	// DataOffset, and the volume lives on DataDevice, a mapping of the
	// disk from there.
	DataOffset int64  `json:"data_offset,omitempty"`
	DataDevice string `json:"data_device,omitempty"`
	// PodDevice is what the pod of a raw block volume on DataDevice (not
	// encrypted) is given: a loop device over DataDevice from its byte 0
	// (poddev.go). Recorded before it is bound, no longer named before
	// it is detached.
	PodDevice string       `json:"pod_device,omitempty"`
	Method    fence.Method `json:"fence_method"`
	Key       fence.Key    `json:"key,omitempty"`
	Phase     Phase        `json:"phase"`
	State     State        `json:"state"`
	Detail    string       `json:"detail,omitempty"`
	// Missing is set while the claimed device cannot be found or is no
	// longer the disk it was staged on; the volume is then abnormal.
	Missing    bool      `json:"missing,omitempty"`
	HolderKey  fence.Key `json:"holder_key,omitempty"`
	HolderNode string    `json:"holder_node,omitempty"`
	// IONotStopped: the claim was lost and its I/O could not be shown
	// stopped (the filesystem stop or the read-only flag failed). A
	// lease-fenced one keeps the host watchdog unfed, across agent
	// restarts, until a stop succeeds.
	IONotStopped bool `json:"io_not_stopped,omitempty"`
	// Formatted is set once this agent made the filesystem, and
	// LUKSFormatted once it made the LUKS2 header: from then on a device
	// that looks blank is a fault to report, never a device to format
	// (docs/architecture.md P5).
	Formatted     bool `json:"formatted,omitempty"`
	LUKSFormatted bool `json:"luks_formatted,omitempty"`
	// Formatting is recorded just before this agent runs mkfs on a device
	// it proved blank, and cleared, with Formatted set, once mkfs has
	// finished: a device whose record names an mkfs may hold what that
	// mkfs left when a crash cut it short, which is made again when it is
	// where that mkfs ran and nothing can have mounted it (mount.go,
	// cutShortFormatProof); a finished filesystem is mounted as it is.
	Formatting *MkfsAttempt `json:"formatting,omitempty"`
	// LUKSFormatting is set just before this agent formats a blank device
	// and cleared once the header is complete: a device the record says
	// is ours half-formatted is the one case where the agent formats over
	// what it finds, because it wrote it.
	LUKSFormatting bool `json:"luks_formatting,omitempty"`
	// FenceFormatted: the fencing wrote its metadata (the lease area).
	FenceFormatted bool `json:"fence_formatted,omitempty"`
	// Publications are the target paths the volume is bind-mounted at.
	Publications []string  `json:"publications,omitempty"`
	Updated      time.Time `json:"updated"`
}

// MkfsAttempt is an mkfs this agent began on a claim's device.
type MkfsAttempt struct {
	// Offset is where on the disk the device mkfs ran on begins: the
	// claim's DataOffset then (0 for the disk itself).
	Offset int64 `json:"offset"`
	// Size is the device's size when it was proven blank.
	Size int64 `json:"size"`
	// UUID is the filesystem UUID the agent gave mkfs; an xfs that mkfs
	// left marked in progress carries it.
	UUID string `json:"uuid"`
}

// Abnormal reports whether the volume cannot be used as staged.
func (c *Claim) Abnormal() bool { return c.State == StateLost || c.Missing }

// MountDevice is the device the filesystem sits on: the dm-crypt mapping
// for an encrypted volume.
func (c *Claim) MountDevice() string {
	if c.Mapper != "" {
		return c.Mapper
	}
	return c.BaseDevice()
}

// PublishDevice is the device node a raw block volume's pod is given: its
// pod device when it has one, else MountDevice.
func (c *Claim) PublishDevice() string {
	if c.PodDevice != "" {
		return c.PodDevice
	}
	return c.MountDevice()
}

// BaseDevice is what LUKS2 or the filesystem is put on: the data mapping
// when the fencing keeps metadata on the disk, else the disk.
func (c *Claim) BaseDevice() string {
	if c.DataDevice != "" {
		return c.DataDevice
	}
	return c.Device
}

// Store keeps one JSON file per claim under dir. Writes are atomic (write a
// temporary file, fsync, rename, fsync the directory) so a crash leaves
// either the old or the new record; the directory and files must not be
// symlinks, so nothing else on the host can redirect the agent's writes.
type Store struct {
	dir string
	// sys makes the calls of a write or a removal that can fail between
	// a record's old and new state: the system's (fileCalls), but in the
	// volume simulation, which injects its faults there.
	sys storeCalls
}

// storeCalls are the file system calls of Put and Delete that a fault on
// the node can hit: the fsync of a temporary file or of the directory,
// the rename of a written record, the removal of one.
type storeCalls interface {
	Sync(f *os.File) error
	Rename(from, to string) error
	Remove(p string) error
}

// fileCalls are the system's calls.
type fileCalls struct{}

func (fileCalls) Sync(f *os.File) error        { return f.Sync() }
func (fileCalls) Rename(from, to string) error { return os.Rename(from, to) }
func (fileCalls) Remove(p string) error        { return os.Remove(p) }

// OpenStore makes (or checks) the claims directory under stateDir.
func OpenStore(stateDir string) (*Store, error) {
	for _, d := range []string{stateDir, filepath.Join(stateDir, "volumes")} {
		st, err := os.Lstat(d)
		if errors.Is(err, fs.ErrNotExist) {
			if err := os.Mkdir(d, 0o700); err != nil {
				return nil, fmt.Errorf("creating the state directory %s: %w", d, err)
			}
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("state directory %s: %w", d, err)
		}
		if st.Mode()&fs.ModeSymlink != 0 {
			return nil, fmt.Errorf("state directory %s is a symlink; the agent refuses to follow it: replace it with a directory", d)
		}
		if !st.IsDir() {
			return nil, fmt.Errorf("state directory %s is not a directory", d)
		}
	}
	return &Store{dir: filepath.Join(stateDir, "volumes"), sys: fileCalls{}}, nil
}

// Dir is where claims are kept.
func (s *Store) Dir() string { return s.dir }

func (s *Store) file(volume string) string {
	return filepath.Join(s.dir, base64.RawURLEncoding.EncodeToString([]byte(volume))+".json")
}

// Get returns the claim of volume, or nil when there is none.
func (s *Store) Get(volume string) (*Claim, error) {
	p := s.file(volume)
	c, err := s.read(p)
	if err != nil || c == nil {
		return c, err
	}
	if err := ownRecord(p, volume, c); err != nil {
		return nil, err
	}
	return c, nil
}

// ownRecord refuses a record that holds the claim of another volume than
// the one its file is named for (a copy restored under the wrong name, a
// hand edit): acted on, an operation of one volume would take another's
// mounts, fence and record.
func ownRecord(p, volume string, c *Claim) error {
	if c.Volume == volume {
		return nil
	}
	return fmt.Errorf("claim record %s is damaged (it holds the claim of volume %q, not of %q): inspect it; the volume's disk is left alone until it is fixed or removed", p, c.Volume, volume)
}

// RecordError is a claim record List could not read: the volume its name
// says, and why (the error names the file and what to do).
type RecordError struct {
	Volume string
	Err    error
}

func (e *RecordError) Error() string { return e.Err.Error() }
func (e *RecordError) Unwrap() error { return e.Err }

// volumeOfRecord is the volume a record's file name encodes (file), or
// the name itself when it is not one the store writes (a file put there by
// hand): a name that decodes to bytes that are not text would make the
// listing that carries it unsendable.
func volumeOfRecord(name string) string {
	enc := strings.TrimSuffix(name, ".json")
	b, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil || len(b) == 0 || !utf8.Valid(b) || base64.RawURLEncoding.EncodeToString(b) != enc {
		return name
	}
	return string(b)
}

func (s *Store) read(p string) (*Claim, error) {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENAMETOOLONG) {
		// An id too long to name a file was never recorded.
		return nil, nil
	}
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("claim record %s is a symlink; the agent refuses to follow it: remove it", p)
	}
	if err != nil {
		return nil, fmt.Errorf("reading claim record %s: %w", p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	defer f.Close()
	var c Claim
	dec := json.NewDecoder(f)
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("claim record %s is damaged (%v): inspect it; the volume's disk is left alone until it is fixed or removed", p, err)
	}
	return &c, nil
}

// Put writes c atomically.
func (s *Store) Put(c *Claim) error {
	c.Updated = time.Now().UTC()
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
	final := s.file(c.Volume)
	tmp := final + ".tmp"
	_ = unix.Unlink(tmp) // left over from a crash mid-write; never a symlink target
	fd, err := unix.Open(tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("writing claim of volume %s: %w", c.Volume, err)
	}
	f := os.NewFile(uintptr(fd), tmp)
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("writing claim of volume %s: %w", c.Volume, err)
	}
	if err := s.sys.Sync(f); err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("syncing claim of volume %s: %w", c.Volume, err)
	}
	if err := f.Close(); err != nil {
		os.Remove(tmp)
		return err
	}
	if st, err := os.Lstat(final); err == nil && st.Mode()&fs.ModeSymlink != 0 {
		os.Remove(tmp)
		return fmt.Errorf("claim record %s is a symlink; the agent refuses to replace it: remove it", final)
	}
	if err := s.sys.Rename(tmp, final); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("saving claim of volume %s: %w", c.Volume, err)
	}
	return s.syncDir()
}

func (s *Store) syncDir() error {
	d, err := os.Open(s.dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return s.sys.Sync(d)
}

// Delete removes the claim of volume; a missing one is fine.
func (s *Store) Delete(volume string) error {
	if err := s.sys.Remove(s.file(volume)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing claim of volume %s: %w", volume, err)
	}
	return s.syncDir()
}

// List returns every claim, ordered by volume. A damaged record is
// reported, not skipped silently.
func (s *Store) List() ([]*Claim, []error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, []error{fmt.Errorf("listing claims in %s: %w", s.dir, err)}
	}
	var out []*Claim
	var errs []error
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		p := filepath.Join(s.dir, e.Name())
		c, err := s.read(p)
		if err == nil && c != nil {
			err = ownRecord(p, volumeOfRecord(e.Name()), c)
		}
		if err != nil {
			errs = append(errs, &RecordError{Volume: volumeOfRecord(e.Name()), Err: err})
			continue
		}
		if c != nil {
			out = append(out, c)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Volume < out[j].Volume })
	return out, errs
}
