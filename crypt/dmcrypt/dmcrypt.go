// Package dmcrypt maps an unlocked LUKS2 volume as a dm-crypt device where
// luks.go cannot (package crypt), grows a mapping online and removes it,
// whether luks.go or this package set it up. It uses github.com/anatol/devmapper.go
// for device creation, removal and status, and its own ioctls for what that
// library lacks (see ioctl.go): loading a table with the secure-data flag,
// resuming with NOFLUSH|SKIP_LOCKFS, and reading a table back. It also makes
// the /dev/mapper/<name> node itself when no udev runs (initramfs, minimal
// images).
package dmcrypt

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	devmapper "github.com/anatol/devmapper.go"
	"golang.org/x/sys/unix"
)

// Mapping describes a dm-crypt device.
type Mapping struct {
	// Name is the device-mapper name: /dev/mapper/<Name>.
	Name string
	// UUID is the device-mapper UUID; cryptsetup's convention
	// CRYPT-LUKS2-<uuid without dashes>-<name> is used by MappingUUID.
	UUID string
	// Device is the backing block device.
	Device string
	// Offset is where the encrypted data starts on Device, in bytes.
	Offset uint64
	// Length is the size of the mapping in bytes (a multiple of
	// SectorSize).
	Length uint64
	// Cipher is the dm-crypt cipher, e.g. aes-xts-plain64.
	Cipher string
	// Key is the volume key. Create does not keep it.
	Key []byte
	// IVTweak is the IV offset in sectors.
	IVTweak uint64
	// SectorSize is the encryption sector size (512..4096).
	SectorSize int
	// AllowDiscards passes discards through to the backing device.
	AllowDiscards bool
	// ReadOnly makes the mapping read-only.
	ReadOnly bool
}

// MappingUUID builds the dm UUID cryptsetup would give the mapping, so
// tools such as lsblk and systemd recognise it.
func MappingUUID(luksUUID, name string) string {
	return "CRYPT-LUKS2-" + strings.ReplaceAll(luksUUID, "-", "") + "-" + name
}

// CleanupTimeout is how long the removal of a mapping that failed half
// way retries while the device is busy: udev probes a new mapping as soon
// as it is resumed, and a removal that gave up at once left the mapping
// behind, refusing every retry of the stage with "already exists".
const CleanupTimeout = 10 * time.Second

// udevWait is how long ensureNode waits for udev to make a mapping's node
// before it makes it itself; udev on a loaded host took over 2 s.
const udevWait = 10 * time.Second

// Path is the device node of a mapping.
func Path(name string) string { return filepath.Join("/dev/mapper", name) }

func (m *Mapping) params() ([]byte, error) {
	if m.SectorSize == 0 {
		m.SectorSize = 512
	}
	if m.Offset%512 != 0 || m.Length%uint64(m.SectorSize) != 0 || m.Length == 0 {
		return nil, fmt.Errorf("dm-crypt %s: offset %d and length %d must be whole sectors", m.Name, m.Offset, m.Length)
	}
	var opts []string
	if m.AllowDiscards {
		opts = append(opts, "allow_discards")
	}
	if m.SectorSize != 512 {
		opts = append(opts, "sector_size:"+strconv.Itoa(m.SectorSize))
	}
	key := make([]byte, hex.EncodedLen(len(m.Key)))
	hex.Encode(key, m.Key)
	defer clear(key)
	p := []byte(m.Cipher + " ")
	p = append(p, key...)
	p = append(p, fmt.Sprintf(" %d %s %d", m.IVTweak, m.Device, m.Offset/512)...)
	if len(opts) > 0 {
		p = append(p, fmt.Sprintf(" %d %s", len(opts), strings.Join(opts, " "))...)
	}
	return p, nil
}

// Create sets the mapping up and returns its device node path.
func Create(m Mapping) (string, error) {
	if m.Name == "" || strings.ContainsAny(m.Name, "/ ") {
		return "", fmt.Errorf("dm-crypt: invalid mapping name %q", m.Name)
	}
	params, err := m.params()
	if err != nil {
		return "", err
	}
	defer clear(params)
	if err := Available(); err != nil {
		return "", fmt.Errorf("dm-crypt %s: %w", m.Name, err)
	}
	if err := devmapper.Create(m.Name, m.UUID); err != nil {
		if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.EEXIST) {
			return "", ExistsError(m.Name)
		}
		return "", fmt.Errorf("dm-crypt %s: create: %w", m.Name, err)
	}
	fail := func(step string, err error) (string, error) {
		_ = Remove(m.Name, CleanupTimeout)
		return "", fmt.Errorf("dm-crypt %s on %s: %s: %w", m.Name, m.Device, step, err)
	}
	var ro uint32
	if m.ReadOnly {
		ro = unix.DM_READONLY_FLAG
	}
	if err := loadTableFlags(m.Name, "crypt", 0, m.Length/512, params, ro); err != nil {
		return fail("load table", err)
	}
	if err := resume(m.Name, 0); err != nil {
		return fail("resume", err)
	}
	if err := ensureNode(m.Name); err != nil {
		return fail("device node", err)
	}
	return Path(m.Name), nil
}

// EnsureNode makes /dev/mapper/<name> for a mapping another library set
// up (luks.go's SetupMapper does not make it when no udev runs) and checks
// an existing node has the mapping's device number.
func EnsureNode(name string) error {
	if err := ensureNode(name); err != nil {
		return fmt.Errorf("dm-crypt %s: device node: %w", name, err)
	}
	return nil
}

// Exists reports whether a device-mapper device named name exists.
func Exists(name string) (bool, error) {
	_, err := devmapper.InfoByName(name)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.ENXIO) || errors.Is(err, unix.ENOENT):
		return false, nil
	}
	return false, fmt.Errorf("dm-crypt %s: %w", name, err)
}

// ExistsError is the error for a name already mapped.
func ExistsError(name string) error {
	return fmt.Errorf("dm-crypt: a mapping named %s already exists; close it first ('vco-agent luks close %s')", name, name)
}

// udevRunning reports whether udevd will create device nodes.
func udevRunning() bool {
	_, err := os.Stat("/run/udev/control")
	return err == nil
}

// ensureNode makes /dev/mapper/<name> when udev does not, and checks an
// existing node has the mapping's device number.
func ensureNode(name string) error {
	info, err := devmapper.InfoByName(name)
	if err != nil {
		return err
	}
	p := Path(name)
	deadline := time.Now().Add(udevWait)
	if !udevRunning() {
		deadline = time.Now()
	}
	for {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err == nil {
			if st.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == info.DevNo {
				return nil
			}
			// A stale node from an earlier mapping: replace it.
			if err := os.Remove(p); err != nil {
				return err
			}
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := os.MkdirAll("/dev/mapper", 0o755); err != nil {
		return err
	}
	return unix.Mknod(p, unix.S_IFBLK|0o600, int(info.DevNo))
}

// Status is what the kernel reports about a mapping.
type Status struct {
	Name      string `json:"name"`
	UUID      string `json:"uuid"`
	DevNo     uint64 `json:"devno"`
	OpenCount int32  `json:"open_count"`
	ReadOnly  bool   `json:"read_only"`
	Suspended bool   `json:"suspended"`
	// Length is the mapping's size in bytes.
	Length uint64 `json:"length"`
	// Table is the crypt target's parameters with the key replaced by "-".
	Table string `json:"table"`
}

// GetStatus reads the mapping's state and table (without its key).
func GetStatus(name string) (*Status, error) {
	if err := Available(); err != nil {
		return nil, fmt.Errorf("dm-crypt %s: %w", name, err)
	}
	info, err := devmapper.InfoByName(name)
	if err != nil {
		return nil, fmt.Errorf("dm-crypt %s: %w", name, err)
	}
	tt, err := readTable(name, true)
	if err != nil {
		return nil, fmt.Errorf("dm-crypt %s: read table: %w", name, err)
	}
	s := &Status{Name: info.Name, UUID: info.UUID, DevNo: info.DevNo, OpenCount: info.OpenCount,
		ReadOnly: info.Flags&unix.DM_READONLY_FLAG != 0, Suspended: info.Flags&unix.DM_SUSPEND_FLAG != 0}
	for _, t := range tt {
		s.Length += t.Length * 512
		parts := []string{t.Type}
		for i, f := range bytes.Fields(t.Params) {
			if t.Type == "crypt" && i == 1 {
				parts = append(parts, "-")
				continue
			}
			parts = append(parts, string(f))
		}
		clear(t.Params)
		s.Table = strings.TrimSpace(s.Table + " " + strings.Join(parts, " "))
	}
	return s, nil
}

// Resize sets the mapping's length to newLength bytes while it stays in
// use: the live table is read back (the kernel returns the key, so no
// passphrase is needed), reloaded with the new length, and swapped in with
// NOFLUSH|SKIP_LOCKFS so a mounted filesystem sees neither a flush barrier
// nor a freeze. The filesystem is grown afterwards by the caller.
func Resize(name string, newLength uint64) error {
	if err := Available(); err != nil {
		return fmt.Errorf("dm-crypt %s: %w", name, err)
	}
	tt, err := readTable(name, true)
	if err != nil {
		return fmt.Errorf("dm-crypt %s: read table: %w", name, err)
	}
	if len(tt) != 1 || tt[0].Type != "crypt" {
		return fmt.Errorf("dm-crypt %s: not a single crypt target", name)
	}
	params := tt[0].Params
	defer clear(params)
	_, _, sector := cryptTableFields(params)
	if newLength == 0 || newLength%uint64(sector) != 0 {
		return fmt.Errorf("dm-crypt %s: new length %d is not a positive multiple of the %d-byte sector", name, newLength, sector)
	}
	info, err := devmapper.InfoByName(name)
	if err != nil {
		return err
	}
	var flags uint32
	if info.Flags&unix.DM_READONLY_FLAG != 0 {
		flags = unix.DM_READONLY_FLAG
	}
	if err := loadTableFlags(name, "crypt", 0, newLength/512, params, flags); err != nil {
		return fmt.Errorf("dm-crypt %s: load resized table: %w", name, err)
	}
	if err := resume(name, unix.DM_NOFLUSH_FLAG|unix.DM_SKIP_LOCKFS_FLAG); err != nil {
		_ = clearInactive(name)
		return fmt.Errorf("dm-crypt %s: resume with the resized table: %w", name, err)
	}
	return nil
}

// Remove tears the mapping down. While the device is busy (mounted, held
// by another mapping, open) it retries until timeout, then fails naming
// what holds it. A mapping that does not exist is not an error.
func Remove(name string, timeout time.Duration) error {
	if err := Available(); err != nil {
		return fmt.Errorf("dm-crypt %s: %w", name, err)
	}
	info, err := devmapper.InfoByName(name)
	if errors.Is(err, unix.ENXIO) || errors.Is(err, unix.ENOENT) {
		removeNode(name, 0)
		return nil
	}
	if err != nil {
		return fmt.Errorf("dm-crypt %s: %w", name, err)
	}
	deadline := time.Now().Add(timeout)
	for {
		err = devmapper.Remove(name)
		if err == nil {
			removeNode(name, info.DevNo)
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("dm-crypt %s is busy: %s; unmount or close it first", name, strings.Join(Holders(info.DevNo), ", "))
	}
	return fmt.Errorf("dm-crypt %s: remove: %w", name, err)
}

// removeNode deletes a node Create made when no udev runs.
func removeNode(name string, devno uint64) {
	if udevRunning() {
		return
	}
	var st unix.Stat_t
	p := Path(name)
	if unix.Stat(p, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK && (devno == 0 || st.Rdev == devno) {
		_ = os.Remove(p)
	}
}

// Holders names what keeps device devno busy: mappings or partitions
// stacked on it (/sys/block/<dev>/holders) and mount points of it.
func Holders(devno uint64) []string {
	maj, min := unix.Major(devno), unix.Minor(devno)
	var out []string
	dir := fmt.Sprintf("/sys/dev/block/%d:%d/holders", maj, min)
	if ents, err := os.ReadDir(dir); err == nil {
		for _, e := range ents {
			desc := e.Name()
			if n, err := os.ReadFile(filepath.Join(dir, e.Name(), "dm", "name")); err == nil {
				desc += " (" + strings.TrimSpace(string(n)) + ")"
			}
			out = append(out, "held by "+desc)
		}
	}
	out = append(out, mountsOf(maj, min)...)
	if len(out) == 0 {
		out = append(out, "open by a process (no holder or mount found)")
	}
	return out
}

// mountsOf lists the mount points of device maj:min from mountinfo.
func mountsOf(maj, min uint32) []string {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	want := fmt.Sprintf("%d:%d", maj, min)
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[2] == want {
			out = append(out, "mounted at "+unescapeMount(f[4]))
		}
	}
	return out
}

func unescapeMount(s string) string {
	r := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	return r.Replace(s)
}

// GrowToDevice resizes the mapping to fill its backing device (after the
// disk underneath was grown) and returns the new length in bytes.
func GrowToDevice(name string) (uint64, error) {
	if err := Available(); err != nil {
		return 0, fmt.Errorf("dm-crypt %s: %w", name, err)
	}
	full, err := readTable(name, true)
	if err != nil {
		return 0, fmt.Errorf("dm-crypt %s: read table: %w", name, err)
	}
	if len(full) != 1 || full[0].Type != "crypt" {
		return 0, fmt.Errorf("dm-crypt %s: not a single crypt target", name)
	}
	backing, offSectors, sector := cryptTableFields(full[0].Params)
	clear(full[0].Params)
	if backing == "" {
		return 0, fmt.Errorf("dm-crypt %s: unexpected crypt table", name)
	}
	off, err := strconv.ParseUint(offSectors, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("dm-crypt %s: bad offset %q in table", name, offSectors)
	}
	raw, err := os.ReadFile(filepath.Join("/sys/dev/block", backing, "size"))
	if err != nil {
		return 0, fmt.Errorf("dm-crypt %s: size of backing device %s: %w", name, backing, err)
	}
	sectors, err := strconv.ParseUint(strings.TrimSpace(string(raw)), 10, 64)
	if err != nil || sectors <= off {
		return 0, fmt.Errorf("dm-crypt %s: backing device %s has %d sectors, data starts at %d", name, backing, sectors, off)
	}
	length := (sectors - off) * 512
	length -= length % uint64(sector)
	if err := Resize(name, length); err != nil {
		return 0, err
	}
	return length, nil
}

// cryptTableFields picks the backing device, the data offset (in 512-byte
// sectors) and the sector size out of a crypt table line without copying
// the key that sits in it.
func cryptTableFields(params []byte) (backing, offset string, sector int) {
	f := bytes.Fields(params)
	sector = 512
	if len(f) < 5 {
		return "", "", sector
	}
	for _, o := range f[5:] {
		if v, ok := bytes.CutPrefix(o, []byte("sector_size:")); ok {
			if n, err := strconv.Atoi(string(v)); err == nil {
				sector = n
			}
		}
	}
	return string(f[3]), string(f[4]), sector
}
