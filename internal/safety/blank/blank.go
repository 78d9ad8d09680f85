// Package blank proves a block device blank: the one test every format the
// agent makes (a filesystem, a LUKS2 header, the lease area) must pass
// first, so that nothing is written over data the project did not create
// (docs/architecture.md, P5). A format takes a Proof, and only the Prove
// functions of this package make one.
package blank

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

const (
	// HeadSize is how much of the start of a device is read and must be
	// zeros: the first MiB, the lease area's data offset region (the
	// lease keeps its data from 1 MiB) and every offset a LUKS2 secondary
	// header can sit at (16 KiB to 4 MiB), with that header.
	HeadSize = 5 << 20
	// TailSize is how much of the end of a device must be zeros (GPT
	// backup headers, md 0.90/1.0 superblocks and others live there).
	TailSize = 1 << 20

	// LeaseMagic begins block 0 of the on-disk lease area (fence/lease);
	// a test there keeps the two in step.
	LeaseMagic = "VCOLEASE"
	// LeaseDataOffset is where a lease-carrying disk keeps its data; the
	// head read covers the MiB from there (a test in fence/lease keeps
	// it in step).
	LeaseDataOffset = 1 << 20
)

var (
	luksPrimary   = []byte("LUKS\xba\xbe")
	luksSecondary = []byte("SKUL\xba\xbe")
	// luksSecondaryOffsets are the LUKS2 header sizes, hence where the
	// secondary header can start.
	luksSecondaryOffsets = []int64{16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20}
)

// Proof says that a device was found blank, or holding only what a format
// of the caller's own left. Only Prove, ProvePast, ProveEncrypted and
// ProveFormatLeftovers make a non-zero one; every format of the agent
// takes one.
type Proof struct {
	path  string
	id    FileID
	size  int64
	from  int64
	taken time.Time
	sim   bool
}

// Simulated is a proof for a device that exists only in a simulation of
// the node (the volume manager's, agent/volume): it lets the simulated
// node's format run. Every real format refuses it (Simulated), so it can
// never stand for a device of the host.
func Simulated(path string, size int64) Proof {
	return Proof{path: path, size: size, taken: time.Now(), sim: true}
}

// Simulated reports whether p was made by Simulated: no real device may
// be formatted on it.
func (p Proof) Simulated() bool { return p.sim }

// FileID is what a path named when it was opened: a block device by its
// device number (Rdev), any file by its filesystem and inode. A path can be
// made to name another device (a /dev/disk/by-* link retargeted, a node
// made anew); its FileID then differs.
type FileID struct{ Dev, Ino, Rdev uint64 }

// FileIDOf is the FileID of a file's stat.
func FileIDOf(st *unix.Stat_t) FileID { return FileID{Dev: st.Dev, Ino: st.Ino, Rdev: st.Rdev} }

func fileIDOf(f *os.File) (FileID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return FileID{}, err
	}
	return FileIDOf(&st), nil
}

// Device is the path that was proven blank.
func (p Proof) Device() string { return p.path }

// File is what Device named when it was proven blank.
func (p Proof) File() FileID { return p.id }

// StillNames checks that the path p proved still names what it named
// then (File): a disk removed and another attached at its device node,
// or a link retargeted, is another device, which no format may take p
// for. A format calls it last before it writes.
func (p Proof) StillNames() error {
	var st unix.Stat_t
	if err := unix.Stat(p.path, &st); err != nil {
		return fmt.Errorf("%s: %w", p.path, err)
	}
	if FileIDOf(&st) != p.id {
		return fmt.Errorf("%s names another device than when it was proven blank; nothing is formatted, it is proven again", p.path)
	}
	return nil
}

// Size is the device's size when it was proven blank.
func (p Proof) Size() int64 { return p.size }

// From is where the proven-blank part begins: 0 for the whole device
// (Prove), the given offset for ProvePast.
func (p Proof) From() int64 { return p.from }

// Valid reports whether p was made by one of this package's Prove
// functions.
func (p Proof) Valid() bool { return p.path != "" }

// Taken is when the checks of p began: the device was blank then, and
// nothing this package can see says what it holds now.
func (p Proof) Taken() time.Time { return p.taken }

// NotBlankError says what was found on a device that is not blank.
type NotBlankError struct {
	Device string
	// Found names it: "a vco-agent lease area (header at byte 0)",
	// "blkid: TYPE=ext4", "non-zero data at byte 1052672 (the lease data
	// offset region)".
	Found string
	// Type and PTType are what `blkid -p` named, its TYPE (a filesystem,
	// crypto_LUKS, a RAID member...) and PTTYPE (a partition table); ""
	// when it named none, also when it did not run (ProvePast).
	Type, PTType string
}

func (e *NotBlankError) Error() string {
	return fmt.Sprintf("%s is not blank: it holds %s", e.Device, e.Found)
}

// Prove reads the device at path and returns a Proof when it is blank:
// no lease header, no LUKS header (primary or secondary), no signature the
// project knows (crypt/luks2's list) or `blkid -p` finds, and the first
// HeadSize and last TailSize bytes read as zeros. The reads bypass the
// page cache (O_DIRECT). Anything found is a *NotBlankError naming it; an
// error of another kind means the device could not be read, and is no
// proof either.
func Prove(ctx context.Context, path string) (Proof, error) {
	taken := time.Now()
	r, err := readUnsigned(ctx, path, (*regions).signature, "")
	if err != nil {
		return Proof{}, err
	}
	if found := r.nonZero(); found != "" {
		return Proof{}, &NotBlankError{Device: path, Found: found}
	}
	return Proof{path: path, id: r.id, size: r.size, taken: taken}, nil
}

// ProveEncrypted proves blank the opened dm-crypt mapping of a LUKS2
// volume whose header the caller wrote itself, over a device Prove
// proved blank: its plaintext is the decryption of those zeros, which
// reads as noise, so no zero check can speak for it. What is asked of it
// is that no signature the project knows or `blkid -p` finds is there,
// which would mean someone wrote the volume since.
func ProveEncrypted(ctx context.Context, mapping string) (Proof, error) {
	// Not r.signature: crypt/luks2's check takes any non-zero data for
	// an unknown signature, and noise is what this device holds.
	taken := time.Now()
	r, err := readUnsigned(ctx, mapping, (*regions).headers, "")
	if err != nil {
		return Proof{}, err
	}
	return Proof{path: mapping, id: r.id, size: r.size, taken: taken}, nil
}

// ProveFormatLeftovers is for a filesystem of type fsType with the UUID
// uuid that the caller began to make with mkfs on a device Prove proved
// blank, and that a crash cut short. mkfs writes across the whole device
// (bitmaps, inode tables, the journal, backup superblocks), so no zero
// check can tell its leftovers from other data. What is asked instead is
// that nothing there can have been used since: no lease or LUKS header,
// and nothing `blkid -p` names, but for an xfs superblock marked in
// progress that carries uuid (mkfs.xfs writes its superblock first with
// sb_inprogress set and clears it last; blkid names it, no kernel mounts
// it). A finished filesystem of type fsType is a *NotBlankError whose Type
// is fsType: the mkfs finished, and the filesystem may have been mounted
// since, by this node or another.
func ProveFormatLeftovers(ctx context.Context, path, fsType, uuid string) (Proof, error) {
	if fsType == "" {
		return Proof{}, errors.New("no filesystem type whose leftovers to accept")
	}
	taken := time.Now()
	allow := ""
	if fsType == "xfs" {
		allow = "xfs"
	}
	r, err := readUnsigned(ctx, path, (*regions).headers, allow)
	if err != nil {
		return Proof{}, err
	}
	if r.allowed != "" {
		switch inProgress, ours := xfsInProgress(r.head, uuid); {
		case !inProgress:
			return Proof{}, &NotBlankError{Device: path, Found: "blkid: TYPE=xfs, a finished xfs", Type: "xfs"}
		case !ours:
			return Proof{}, &NotBlankError{Device: path, Found: "an unfinished xfs with another UUID than the one given to mkfs"}
		}
	}
	return Proof{path: path, id: r.id, size: r.size, taken: taken}, nil
}

// xfsInProgress reads the xfs superblock at the start of head: whether its
// sb_inprogress byte (offset 126) is set, and whether its sb_uuid (offset
// 32) is uuid.
func xfsInProgress(head []byte, uuid string) (inProgress, ours bool) {
	if len(head) <= 126 || !bytes.HasPrefix(head, []byte("XFSB")) || head[126] == 0 {
		return false, false
	}
	want, err := hex.DecodeString(strings.ReplaceAll(uuid, "-", ""))
	return true, err == nil && len(want) == 16 && bytes.Equal(head[32:48], want)
}

// readUnsigned reads the device at path and returns what it read when
// neither find (on what was read) nor `blkid -p` finds a signature, other
// than a filesystem of type allow when that is not ""; one found is a
// *NotBlankError naming it, with what blkid named (its Type, which the
// agent mounts when it is the volume's filesystem).
//
// blkid runs while the device is read: its start is a process start, the
// slowest part of a proof on a small machine, and the two wait on
// different things. Both must find nothing; what the reads find is
// reported first.
func readUnsigned(ctx context.Context, path string, find func(*regions) string, allow string) (*regions, error) {
	bctx, stop := context.WithCancel(ctx)
	defer stop()
	blkid := make(chan probed, 1)
	go func() { blkid <- probeBlkid(bctx, path) }()
	r, err := readChecked(ctx, path)
	if err != nil {
		stop()
		<-blkid
		return nil, err
	}
	p := <-blkid
	if p.err != nil {
		// Whatever the reads found, what blkid would have named (the
		// filesystem a caller mounts) is unknown.
		return nil, p.err
	}
	if found := find(r); found != "" {
		return nil, &NotBlankError{Device: path, Found: found, Type: p.typ, PTType: p.pttype}
	}
	if p.found != "" && (allow == "" || p.typ != allow || p.pttype != "") {
		return nil, &NotBlankError{Device: path, Found: p.found, Type: p.typ, PTType: p.pttype}
	}
	if p.found != "" {
		r.allowed = p.typ
	}
	return r, nil
}

// ProvePast proves blank everything of the device the checks cover from
// offset from on: no lease header at byte 0, zeros in the HeadSize bytes
// from from and in the last TailSize bytes. It is for a format this agent
// began and a crash cut short: what lies before from is its own
// leftovers, which no signature check can tell from foreign data.
func ProvePast(ctx context.Context, path string, from int64) (Proof, error) {
	if from <= 0 {
		return Prove(ctx, path)
	}
	taken := time.Now()
	r, err := readFrom(ctx, path, from)
	if err != nil {
		return Proof{}, err
	}
	if bytes.HasPrefix(r.lead, []byte(LeaseMagic)) {
		return Proof{}, &NotBlankError{Device: path, Found: "a vco-agent lease area (its header at byte 0)"}
	}
	if found := r.nonZero(); found != "" {
		return Proof{}, &NotBlankError{Device: path, Found: found}
	}
	return Proof{path: path, id: r.id, size: r.size, from: from, taken: taken}, nil
}

// Recheck reads again the parts of the device p proved blank that its zero
// checks read (the first HeadSize and the last TailSize bytes) and returns
// p when they still read as zeros; anything there now is a *NotBlankError
// naming it. It is for a format that takes a proof made moments before
// (fence/lease's, FormatOptions.Proof): the zero checks are as fresh as
// the write, the signature checks as old as p.
func Recheck(ctx context.Context, p Proof) (Proof, error) {
	if !p.Valid() || p.From() != 0 {
		return Proof{}, fmt.Errorf("%s: no proof of the whole device to check again", p.path)
	}
	sc, err := allZero(ctx, p.path)
	switch {
	case err != nil:
		return Proof{}, err
	case sc.id != p.id:
		return Proof{}, fmt.Errorf("%s names another device than when it was proven blank; it is proven again", p.path)
	case sc.size != p.size:
		return Proof{}, fmt.Errorf("%s: %d bytes now, %d when it was proven blank; it is proven again", p.path, sc.size, p.size)
	case sc.zero:
		return p, nil
	}
	r, err := read(ctx, p.path)
	if err != nil {
		return Proof{}, err
	}
	found := r.signature()
	if found == "" {
		found = r.nonZero()
	}
	if found == "" {
		found = "data that changed while it was read"
	}
	return Proof{}, &NotBlankError{Device: p.path, Found: found}
}

// readChecked is read for a proof: a device whose regions are all zeros
// (allZero) gives regions that hold nothing, as no check can find
// anything in zeros; any other is read whole.
func readChecked(ctx context.Context, path string) (*regions, error) {
	sc, err := allZero(ctx, path)
	if err != nil {
		return nil, err
	}
	if sc.zero {
		return &regions{id: sc.id, size: sc.size, zero: true}, nil
	}
	return read(ctx, path)
}

// regions is what was read of a device.
type regions struct {
	// zero says the regions were all zeros (readChecked) and were not
	// kept: nothing is in them.
	zero bool
	// allowed is the filesystem type blkid named that the caller of
	// readUnsigned allowed; "" when blkid named nothing.
	allowed string
	id      FileID
	size    int64
	lead    []byte // the first block, for the lease magic (ProvePast)
	head    []byte // HeadSize bytes from headOff (or up to the end)
	headOff int64
	tail    []byte // the last TailSize bytes (or the whole device)
	tailOff int64
}

// signature names the first known signature in the head or tail:
// crypt/luks2's list first (it names the lease and LUKS headers too), then
// the lease and LUKS headers this package looks for itself, which include
// the LUKS2 secondary headers past the first MiB.
func (r *regions) signature() string {
	if r.zero {
		return ""
	}
	if sig, err := luks2.DetectSignature(r, uint64(r.size)); err == nil && sig != "" {
		return sig
	}
	return r.headers()
}

// headers names a lease or LUKS header in what was read, or "".
func (r *regions) headers() string {
	if r.zero {
		return ""
	}
	if bytes.HasPrefix(r.head, []byte(LeaseMagic)) {
		return "a vco-agent lease area (its header at byte 0)"
	}
	if bytes.HasPrefix(r.head, luksPrimary) {
		return "a LUKS header at byte 0"
	}
	for _, off := range luksSecondaryOffsets {
		if off+int64(len(luksSecondary)) <= int64(len(r.head)) && bytes.Equal(r.head[off:off+int64(len(luksSecondary))], luksSecondary) {
			return fmt.Sprintf("a LUKS2 secondary header at byte %d", off)
		}
	}
	return ""
}

// ReadAt serves luks2.DetectSignature from what was read; it reads only
// the first MiB and the last 64 KiB, both inside head and tail.
func (r *regions) ReadAt(p []byte, off int64) (int, error) {
	for _, s := range []struct {
		b   []byte
		off int64
	}{{r.head, r.headOff}, {r.tail, r.tailOff}} {
		if off >= s.off && off+int64(len(p)) <= s.off+int64(len(s.b)) {
			return copy(p, s.b[off-s.off:]), nil
		}
	}
	if off >= r.size {
		return 0, io.EOF
	}
	return 0, fmt.Errorf("bytes %d-%d were not read for the blank check", off, off+int64(len(p)))
}

// nonZero names the first non-zero byte of the head and tail.
func (r *regions) nonZero() string {
	if r.zero {
		return ""
	}
	if i := firstNonZero(r.head); i >= 0 {
		return describe(r.headOff + i)
	}
	if i := firstNonZero(r.tail); i >= 0 {
		return fmt.Sprintf("non-zero data at byte %d, in the last MiB", r.tailOff+i)
	}
	return ""
}

func firstNonZero(b []byte) int64 { return int64(FirstNonZero(b)) }

// FirstNonZero is the index of the first byte of b that is not zero, or
// -1. It ORs eight machine words at a time and looks at single bytes only
// where a group is not zero: a proof reads 6 MiB, and in an emulated
// guest (TCG) plain word operations run several times faster than the
// runtime's vector compare (5.6 ms against 0.8 ms for 6 MiB,
// docs/benchmarks.md), and a byte loop slower still.
func FirstNonZero(b []byte) int {
	// The bytes before the first word boundary, one by one.
	lead := 0
	if len(b) > 0 {
		lead = int((wordSize - uintptr(unsafe.Pointer(&b[0]))%wordSize) % wordSize)
	}
	lead = min(lead, len(b))
	if i := firstNonZeroByte(b[:lead]); i >= 0 {
		return i
	}
	rest := b[lead:]
	words := unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(rest))), len(rest)/wordSize)
	const group = 8
	w := 0
	for ; w+group <= len(words); w += group {
		g := words[w : w+group : w+group]
		if g[0]|g[1]|g[2]|g[3]|g[4]|g[5]|g[6]|g[7] != 0 {
			break
		}
	}
	// A group that is not zero, or the last words and bytes past the
	// groups: byte by byte.
	if i := firstNonZeroByte(rest[w*wordSize:]); i >= 0 {
		return lead + w*wordSize + i
	}
	return -1
}

const wordSize = 8

func firstNonZeroByte(b []byte) int {
	for i, c := range b {
		if c != 0 {
			return i
		}
	}
	return -1
}

func describe(at int64) string {
	switch {
	case at < 1<<20:
		return fmt.Sprintf("non-zero data at byte %d, in the first MiB", at)
	case at < LeaseDataOffset+1<<20:
		return fmt.Sprintf("non-zero data at byte %d, in the MiB at the lease data offset (%d)", at, LeaseDataOffset)
	}
	return fmt.Sprintf("non-zero data at byte %d, in the first %d MiB", at, HeadSize>>20)
}

func read(ctx context.Context, path string) (*regions, error) { return readFrom(ctx, path, 0) }

// openAligned opens path for reading, with O_DIRECT where it allows, and
// returns its size and the alignment its reads need (1 without O_DIRECT).
func openAligned(path string) (f *os.File, id FileID, size, align int64, err error) {
	f, direct, err := open(path)
	if err != nil {
		return nil, id, 0, 0, err
	}
	if id, err = fileIDOf(f); err == nil {
		size, align, err = geometry(f)
	}
	if err != nil {
		f.Close()
		return nil, id, 0, 0, fmt.Errorf("%s: %w", path, err)
	}
	if !direct {
		align = 1
	}
	return f, id, size, align, nil
}

// readFrom reads the first block, HeadSize bytes from headOff and the
// last TailSize bytes, with O_DIRECT where the file allows it.
func readFrom(ctx context.Context, path string, headOff int64) (*regions, error) {
	f, id, size, align, err := openAligned(path)
	if err != nil {
		return nil, err
	}
	r := &regions{id: id, size: size, headOff: min(headOff, size)}
	r.headOff -= r.headOff % align
	r.tailOff = max(0, size-TailSize)
	r.tailOff -= r.tailOff % align
	err = bounded(ctx, path, func() error {
		defer f.Close()
		var err error
		if r.lead, err = readAt(f, 0, min(4096, size), align); err == nil {
			if r.head, err = readAt(f, r.headOff, min(HeadSize, size-r.headOff), align); err == nil {
				r.tail, err = readAt(f, r.tailOff, size-r.tailOff, align)
			}
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return r, nil
}

// open opens path with O_DIRECT, so that what this node cached before
// another node wrote the disk is not what is judged; a regular file on a
// filesystem without O_DIRECT (tmpfs, in tests) is read through the cache.
func open(path string) (*os.File, bool, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err == nil {
		return os.NewFile(uintptr(fd), path), true, nil
	}
	if !errors.Is(err, unix.EINVAL) {
		return nil, false, fmt.Errorf("opening %s for the blank check: %w", path, err)
	}
	f, err := os.Open(path)
	return f, false, err
}

// geometry returns the size and the logical block size (the alignment
// O_DIRECT needs) of a block device, or the size of a file.
func geometry(f *os.File) (int64, int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, 0, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return st.Size, 4096, nil
	}
	var sz uint64
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&sz))); e != 0 {
		return 0, 0, fmt.Errorf("reading the device size: %w", e)
	}
	ssz, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKSSZGET)
	if err != nil {
		return 0, 0, fmt.Errorf("reading the logical block size: %w", err)
	}
	return int64(sz), int64(max(ssz, 4096)), nil
}

// readAt reads n bytes at off into a buffer aligned for O_DIRECT.
func readAt(f *os.File, off, n, align int64) ([]byte, error) {
	if n <= 0 {
		return nil, nil
	}
	return readInto(f, alignedBuffer(n, align), off, n)
}

// alignedBuffer is a buffer of at least n bytes, rounded up to align, whose
// start is aligned to align (O_DIRECT reads need both).
func alignedBuffer(n, align int64) []byte {
	padded := (n + align - 1) / align * align
	raw := make([]byte, padded+align)
	skip := int64(0)
	if a := int64(uintptr(unsafe.Pointer(&raw[0]))) % align; a != 0 {
		skip = align - a
	}
	return raw[skip : skip+padded]
}

// readInto reads n bytes at off into buf (from alignedBuffer, at least n
// rounded up to the alignment) and returns them.
func readInto(f *os.File, buf []byte, off, n int64) ([]byte, error) {
	got := int64(0)
	for got < n {
		m, err := unix.Pread(int(f.Fd()), buf[got:], off+got)
		if err != nil {
			return nil, err
		}
		if m == 0 {
			break
		}
		got += int64(m)
	}
	if got < n {
		return nil, fmt.Errorf("short read at byte %d: %d of %d bytes", off, got, n)
	}
	return buf[:n], nil
}

// scanChunk is how much of a device allZero reads at a time.
const scanChunk = 1 << 20

// allZero reads what Prove reads (the first HeadSize and the last
// TailSize bytes) a chunk at a time through one buffer and reports
// whether all of it is zeros, with the device's size and FileID. Every check of a
// proof looks for bytes that are not zero, so a device that passes this
// needs none of them; the regions of a device that does not are read
// whole again to name what is there. A proof of a blank device so
// allocates 1 MiB instead of 6, whose page faults cost more than the
// reads in an emulated guest.
func allZero(ctx context.Context, path string) (scan, error) {
	f, id, size, align, err := openAligned(path)
	if err != nil {
		return scan{}, err
	}
	tailOff := max(0, size-TailSize)
	tailOff -= tailOff % align
	zero := true
	err = bounded(ctx, path, func() error {
		defer f.Close()
		buf, done := scanBuffer(align)
		defer done()
		for _, rg := range [][2]int64{{0, min(HeadSize, size)}, {tailOff, size}} {
			for off := rg[0]; off < rg[1] && zero; off += scanChunk {
				b, err := readInto(f, buf, off, min(scanChunk, rg[1]-off))
				if err != nil {
					return err
				}
				zero = FirstNonZero(b) < 0
			}
		}
		return nil
	})
	if err != nil {
		// The reading goroutine may still run: zero is not read.
		return scan{}, err
	}
	return scan{id: id, size: size, zero: zero}, nil
}

// scanBuffers keeps allZero's buffer between proofs: a MiB allocated
// afresh costs an emulated guest more in page faults than reading it
// (3.6-7.9 ms, docs/benchmarks.md). A buffer goes back only once the read
// that used it has returned, never while a read that hangs may still
// write into it.
var scanBuffers = sync.Pool{New: func() any {
	b := alignedBuffer(scanChunk, pooledAlign)
	return &b
}}

// pooledAlign is the alignment of the pooled buffers: every logical block
// size up to it divides it.
const pooledAlign = 4096

// scanBuffer is a buffer of scanChunk bytes aligned to align, and what
// gives it back.
func scanBuffer(align int64) ([]byte, func()) {
	if pooledAlign%align != 0 {
		return alignedBuffer(scanChunk, align), func() {}
	}
	p := scanBuffers.Get().(*[]byte)
	return *p, func() { scanBuffers.Put(p) }
}

// scan is what allZero found: the file, its size, and whether its regions
// are all zeros.
type scan struct {
	id   FileID
	size int64
	zero bool
}

// bounded runs read, which reads path, and waits for it until ctx ends or
// a minute passes: a read of a disk whose path is gone can hang (the
// reading goroutine then keeps its buffers).
func bounded(ctx context.Context, path string, read func() error) error {
	done := make(chan error, 1)
	go func() { done <- read() }()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("reading %s for the blank check: %w", path, err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("reading %s for the blank check: %w", path, ctx.Err())
	}
}

// probeBlkid asks util-linux's blkid for any signature (-p: a low-level
// probe of the device itself, no cache file). The block device's buffer
// cache is dropped first, so blkid reads what is on the disk now. Exit
// status 2 is "nothing found"; any other failure (blkid missing, an
// ambivalent probe) is no proof.
// ErrProbe is the error of a `blkid -p` that did not answer (missing, an
// ambivalent probe, killed): no proof, and nothing known of what the
// device holds.
var ErrProbe = errors.New("blkid -p, which must find nothing before a format, failed")

// probed is what one `blkid -p` run found: found names it for a
// NotBlankError ("" for nothing), typ and pttype are its TYPE and PTTYPE.
type probed struct {
	found, typ, pttype string
	err                error
}

func probeBlkid(ctx context.Context, path string) probed {
	// blkid reads through the page cache: before, so that it sees what
	// the disk holds now (another node may have written it); after, so
	// that what it read is not served, stale, to a later buffered reader
	// (a buffered loop device over this disk, once another node has
	// written the volume).
	DropBuffers(path)
	defer DropBuffers(path)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "blkid", "-p", "-o", "export", path).Output()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee) && ee.ExitCode() == 2:
		return probed{}
	case err != nil:
		return probed{err: fmt.Errorf("%s: %w: %w", path, ErrProbe, err)}
	}
	var p probed
	var found []string
	for _, l := range strings.Split(string(out), "\n") {
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			continue
		}
		switch k {
		case "TYPE":
			p.typ = v
		case "PTTYPE":
			p.pttype = v
		case "USAGE":
		default:
			continue
		}
		found = append(found, k+"="+v)
	}
	if len(found) == 0 {
		found = []string{"a signature"}
	}
	p.found = "blkid: " + strings.Join(found, " ")
	return p
}

// DropBuffers writes out and drops the page cache of the block device at
// path (BLKFLSBUF); anything else is left alone.
func DropBuffers(path string) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Mode()&os.ModeDevice != 0 {
		_ = unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0)
	}
}

// ProbeBlkid is probeBlkid for callers that want blkid's opinion alone
// (fence/lease's ProbeBlkid): "" when it finds nothing.
func ProbeBlkid(ctx context.Context, path string) (string, error) {
	p := probeBlkid(ctx, path)
	return p.found, p.err
}

// ReadHead reads the first n bytes of the device at path, bypassing the
// page cache as Prove does (for a header that decides how a disk is used,
// such as the lease's).
func ReadHead(ctx context.Context, path string, n int64) ([]byte, error) {
	f, _, size, align, err := openAligned(path)
	if err != nil {
		return nil, err
	}
	type result struct {
		b   []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		defer f.Close()
		b, err := readAt(f, 0, min(n, size), align)
		done <- result{b, err}
	}()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	select {
	case r := <-done:
		if r.err != nil {
			return nil, fmt.Errorf("reading the start of %s: %w", path, r.err)
		}
		return r.b, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("reading the start of %s: %w", path, ctx.Err())
	}
}
