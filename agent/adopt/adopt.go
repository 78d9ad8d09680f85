// Package adopt turns a volume of the driver this one replaces into a
// lease-fenced volume in place. That driver made its filesystem at byte 0
// of the virtio disk, where the lease area belongs (fence/lease: the lease
// owns the first MiB, the data starts at lease.DataOffset). Adopt moves the
// filesystem up by lease.DataOffset and writes the lease header in the room
// that leaves; the disk must first have grown (through the API) by at
// least two MiB past the filesystem: one for the move, and room past it
// for the adoption's own record.
//
// The move runs from the last MiB down, one MiB at a time, so a chunk is
// never written over data not yet moved, and a record in the block just
// past where the moved filesystem ends says how far it got: an adoption
// cut short (a crash, a lost disk) is finished by running it again, also
// after the disk grew meanwhile, and never starts over on moved data.
// The disk must be unused (opened exclusively: nothing mounts or maps it)
// and stays so until Adopt returns. docs/storage.md, "Volumes of the
// earlier driver".
package adopt

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
)

const (
	chunk  = lease.DataOffset // the distance moved, and the unit of a move
	block  = 4096
	magic  = "VCOADOPT"
	extSB  = 1024 // byte offset of an ext2/3/4 superblock
	extMag = 0xEF53
)

// Result says what Adopt did.
type Result struct {
	// FilesystemBytes is the size of the filesystem moved.
	FilesystemBytes int64
	// Resumed is true when a record of an earlier, unfinished adoption
	// was found and that adoption finished.
	Resumed bool
	// AlreadyLease is true when the disk already was a lease volume.
	AlreadyLease bool
}

// Options are Adopt's inputs.
type Options struct {
	Key    fence.Key // this node's, recorded as the lease area's creator
	Logger *slog.Logger
	// StopAfter, for tests only, makes the move return ErrStopped after
	// that many chunks, as a crash would; 0: no stop.
	StopAfter int
	// StopBeforeHeader, for tests only, returns ErrStopped after the
	// move and the zeroing of the first MiB, before the lease header.
	StopBeforeHeader bool
}

// ErrStopped is what a move cut short by Options.StopAfter returns.
var ErrStopped = errors.New("adopt: stopped after Options.StopAfter chunks")

// Adopt moves the ext4 filesystem at byte 0 of the disk at path to
// lease.DataOffset and writes a lease area before it.
func Adopt(ctx context.Context, path string, o Options) (Result, error) {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d, err := openDisk(path)
	if err != nil {
		return Result{}, err
	}
	defer d.f.Close()
	rec, res, finished, err := d.findStart(log)
	if finished || err != nil {
		return res, err
	}
	if err := d.moveUp(ctx, rec, o.StopAfter); err != nil {
		return res, err
	}
	if err := d.write(0, make([]byte, chunk)); err != nil {
		return res, err
	}
	if o.StopBeforeHeader {
		return res, ErrStopped
	}
	ld, err := lease.OpenDevice(path)
	if err != nil {
		return res, err
	}
	err = lease.FormatAdopted(ctx, ld, lease.FormatOptions{Key: o.Key, Logger: log})
	ld.Close()
	if err != nil {
		return res, err
	}
	if err := d.clearRecord(recordOff(rec.fsBytes)); err != nil {
		return res, err
	}
	log.Info("volume adopted: its filesystem now starts at the lease data offset", "device", path, "data_offset", int64(chunk))
	return res, nil
}

// openDisk opens the disk at path exclusively, for direct, synchronous
// I/O.
func openDisk(path string) (*disk, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_DIRECT|unix.O_DSYNC|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("%s is in use (mounted, mapped or held): adopt it only while no pod uses the volume and nothing mounts it", path)
		}
		return nil, fmt.Errorf("opening %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	size, err := unix.IoctlGetUint64(fd, unix.BLKGETSIZE64)
	if err != nil {
		st, serr := f.Stat()
		if serr != nil {
			f.Close()
			return nil, fmt.Errorf("%s: its size: %w", path, err)
		}
		size = uint64(st.Size())
	}
	return &disk{f: f, path: path, size: int64(size) - int64(size)%block}, nil
}

// findStart finds where the adoption stands and returns its record: a new
// one for a filesystem at byte 0, or that of a run cut short. finished
// says the adoption has nothing left to do, with res and err its result.
func (d *disk) findStart(log *slog.Logger) (rec *record, res Result, finished bool, err error) {
	// The record sits just past where the moved filesystem ends, which
	// depends on the filesystem alone: a disk grown again between a run
	// cut short and the next finds it where it was. Until the last step
	// the filesystem's own superblock says its size: at byte 1024 before
	// the first MiB is moved, at DataOffset+1024 after.
	head, err := d.read(0, 2*block)
	if err != nil {
		return nil, Result{}, false, err
	}
	moved, err := d.read(chunk, 2*block)
	if err != nil {
		return nil, Result{}, false, err
	}
	switch {
	case string(head[:8]) == "VCOLEASE":
		res, err := d.finishedHeader(moved)
		return nil, res, true, err
	case isExt4(head):
		rec, res, err := d.startMove(head, log)
		return rec, res, false, err
	case isExt4(moved):
		// Cut short after the first MiB was zeroed: the move is done
		// if the record says so.
		fsBytes, err := ext4Size(moved)
		if err == nil {
			rec, err = d.readRecord(recordOff(fsBytes))
		}
		if err != nil {
			return nil, Result{}, false, fmt.Errorf("%s: %w", d.path, err)
		}
		if rec == nil || rec.next != 0 {
			return nil, Result{}, false, fmt.Errorf("%s: no ext4 filesystem at byte 0 (the earlier driver's layout), and the one at %d has no finished adoption's record: nothing adopted", d.path, int64(chunk))
		}
		return rec, Result{FilesystemBytes: fsBytes, Resumed: true}, false, nil
	}
	return nil, Result{}, false, fmt.Errorf("%s: no ext4 filesystem at byte 0 (the earlier driver's layout): nothing to adopt", d.path)
}

// finishedHeader is the result on a disk that starts with a lease area:
// adopted already, or cut short after the header was written, when only
// the record is left to clear. moved is what lies at the data offset.
func (d *disk) finishedHeader(moved []byte) (Result, error) {
	if fsBytes, err := ext4Size(moved); err == nil {
		// Cut short after the header was written: only the record
		// may be left.
		rec, err := d.readRecord(recordOff(fsBytes))
		if err != nil {
			return Result{}, err
		}
		if rec != nil {
			return Result{FilesystemBytes: fsBytes, Resumed: true}, d.clearRecord(recordOff(fsBytes))
		}
	}
	return Result{AlreadyLease: true}, nil
}

// startMove is the record of the move of the filesystem at byte 0, whose
// superblock head holds: that of a run cut short, or a new one, written.
func (d *disk) startMove(head []byte, log *slog.Logger) (*record, Result, error) {
	fsBytes, err := ext4Size(head)
	if err != nil {
		return nil, Result{}, fmt.Errorf("%s: %w", d.path, err)
	}
	if need := recordOff(fsBytes) + chunk; d.size < need {
		return nil, Result{}, fmt.Errorf("%s: the filesystem takes %d bytes of the disk's %d; grow the disk to at least %d bytes (for example by 1 GiB, resizing the PVC or through the portal) so that it can be moved up by %d bytes, then adopt it", d.path, fsBytes, d.size, need, chunk)
	}
	rec, err := d.readRecord(recordOff(fsBytes))
	if err != nil {
		return nil, Result{}, err
	}
	res := Result{FilesystemBytes: fsBytes}
	if rec != nil {
		res.Resumed = true
		log.Info("finishing an adoption cut short", "device", d.path, "filesystem_bytes", fsBytes, "chunks_left", rec.next)
		return rec, res, nil
	}
	rec = &record{fsBytes: fsBytes, next: (roundUp(fsBytes) + chunk - 1) / chunk}
	if err := d.writeRecord(recordOff(fsBytes), rec); err != nil {
		return nil, Result{}, err
	}
	log.Info("adopting a volume of the earlier driver", "device", d.path, "filesystem_bytes", fsBytes)
	return rec, res, nil
}

// moveUp moves the filesystem up by a chunk, last chunk first, recording
// each chunk moved; stopAfter > 0 stops it after that many (tests).
func (d *disk) moveUp(ctx context.Context, rec *record, stopAfter int) error {
	end := roundUp(rec.fsBytes)
	done := 0
	for rec.next > 0 {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%s: adoption interrupted with %d MiB left to move; run it again to finish: %w", d.path, rec.next, err)
		}
		if stopAfter > 0 && done == stopAfter {
			return ErrStopped
		}
		k := rec.next - 1
		from := k * chunk
		n := min(chunk, end-from)
		b, err := d.read(from, n)
		if err != nil {
			return err
		}
		if err := d.write(from+chunk, b); err != nil {
			return err
		}
		rec.next = k
		if err := d.writeRecord(recordOff(rec.fsBytes), rec); err != nil {
			return err
		}
		done++
	}
	return nil
}

func isExt4(head []byte) bool { return binary.LittleEndian.Uint16(head[extSB+56:]) == extMag }

// ext4Size reads the size of the ext2/3/4 filesystem whose superblock the
// disk's first two blocks hold.
func ext4Size(head []byte) (int64, error) {
	sb := head[extSB:]
	if binary.LittleEndian.Uint16(sb[56:]) != extMag {
		return 0, errors.New("no ext4 filesystem at byte 0 (the earlier driver's layout): nothing to adopt")
	}
	blocks := uint64(binary.LittleEndian.Uint32(sb[4:]))
	if binary.LittleEndian.Uint32(sb[0x60:])&0x80 != 0 { // INCOMPAT_64BIT
		blocks |= uint64(binary.LittleEndian.Uint32(sb[0x150:])) << 32
	}
	logBS := binary.LittleEndian.Uint32(sb[24:])
	if logBS > 6 || blocks == 0 {
		return 0, errors.New("the ext4 superblock at byte 1024 is not sane: nothing adopted")
	}
	return int64(blocks) << (10 + logBS), nil
}

func roundUp(n int64) int64 { return (n + block - 1) / block * block }

// record is the adoption's progress, at recordOff: the size
// of the filesystem being moved and how many chunks are left to move.
type record struct {
	fsBytes int64
	next    int64
}

type disk struct {
	f    *os.File
	path string
	size int64
}

// recordOff is where the record of the adoption of a filesystem of fsBytes
// is kept: the block just past the moved filesystem.
func recordOff(fsBytes int64) int64 { return roundUp(fsBytes) + chunk }

func (d *disk) readRecord(off int64) (*record, error) {
	b, err := d.read(off, block)
	if err != nil {
		return nil, err
	}
	if string(b[:8]) != magic {
		return nil, nil
	}
	if crc32.Checksum(b[:28], crc32.MakeTable(crc32.Castagnoli)) != binary.BigEndian.Uint32(b[28:]) {
		return nil, fmt.Errorf("%s: the adoption record at byte %d is damaged; the disk is left as it is", d.path, off)
	}
	return &record{fsBytes: int64(binary.BigEndian.Uint64(b[8:])), next: int64(binary.BigEndian.Uint64(b[16:]))}, nil
}

func (d *disk) writeRecord(off int64, r *record) error {
	b := make([]byte, block)
	copy(b, magic)
	binary.BigEndian.PutUint64(b[8:], uint64(r.fsBytes))
	binary.BigEndian.PutUint64(b[16:], uint64(r.next))
	binary.BigEndian.PutUint32(b[28:], crc32.Checksum(b[:28], crc32.MakeTable(crc32.Castagnoli)))
	return d.write(off, b)
}

func (d *disk) clearRecord(off int64) error { return d.write(off, make([]byte, block)) }

func (d *disk) read(off, n int64) ([]byte, error) {
	b := aligned(int(n))
	if _, err := d.f.ReadAt(b, off); err != nil {
		return nil, fmt.Errorf("%s: reading %d bytes at %d: %w", d.path, n, off, err)
	}
	return b, nil
}

func (d *disk) write(off int64, data []byte) error {
	b := aligned(len(data))
	copy(b, data)
	if _, err := d.f.WriteAt(b, off); err != nil {
		return fmt.Errorf("%s: writing %d bytes at %d: %w", d.path, len(data), off, err)
	}
	return nil
}

// aligned returns n bytes on a block boundary, as O_DIRECT needs.
func aligned(n int) []byte {
	b := make([]byte, n+block)
	off := 0
	if r := int(uintptr(unsafe.Pointer(&b[0])) % block); r != 0 {
		off = block - r
	}
	return b[off : off+n : off+n]
}
