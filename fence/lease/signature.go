package lease

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"

	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// Layout is what a disk holds, as far as formatting it is concerned.
type Layout int

const (
	// LayoutBlank: the first and last MiB are zeros and no signature is
	// known; the disk may be formatted with the lease.
	LayoutBlank Layout = iota
	// LayoutLease: the disk carries our lease header.
	LayoutLease
	// LayoutForeign: the disk holds something else. It is never formatted.
	LayoutForeign
)

func (l Layout) String() string {
	switch l {
	case LayoutBlank:
		return "blank"
	case LayoutLease:
		return "lease"
	case LayoutForeign:
		return "foreign"
	}
	return fmt.Sprintf("layout %d", int(l))
}

// Classification is the answer of Classify.
type Classification struct {
	Layout Layout
	// Signature names what was found on a foreign disk ("ext4 superblock
	// at 1080", "non-zero data in the first MiB", "blkid: TYPE=xfs").
	Signature string
}

// signature is one magic at a fixed offset, in the style of blkid's
// superblock probes. Offsets are within the first MiB unless fromEnd.
type signature struct {
	name    string
	off     int64
	magic   []byte
	fromEnd bool
}

var signatures = []signature{
	{name: "LUKS header", off: 0, magic: []byte("LUKS\xba\xbe")},
	{name: "LUKS2 secondary header", off: 0x4000, magic: []byte("SKUL\xba\xbe")},
	{name: "XFS superblock", off: 0, magic: []byte("XFSB")},
	{name: "ext2/3/4 superblock", off: 1024 + 56, magic: []byte{0x53, 0xef}},
	{name: "btrfs superblock", off: 0x10000 + 64, magic: []byte("_BHRfS_M")},
	{name: "GPT header", off: 512, magic: []byte("EFI PART")},
	{name: "GPT header (4K sectors)", off: 4096, magic: []byte("EFI PART")},
	{name: "LVM2 label", off: 512 + 24, magic: []byte("LVM2 001")},
	{name: "Linux swap", off: 4096 - 10, magic: []byte("SWAPSPACE2")},
	{name: "Linux swap (old)", off: 4096 - 10, magic: []byte("SWAP-SPACE")},
	{name: "ISO 9660", off: 0x8001, magic: []byte("CD001")},
	{name: "NTFS", off: 3, magic: []byte("NTFS    ")},
	{name: "MD RAID 1.1 superblock", off: 0, magic: []byte{0xfc, 0x4e, 0x2b, 0xa9}},
	{name: "MD RAID 1.2 superblock", off: 4096, magic: []byte{0xfc, 0x4e, 0x2b, 0xa9}},
	{name: "bcache superblock", off: 4096 + 24, magic: []byte{0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba, 0x6d, 0x81}},
	{name: "sanlock lease", off: 0, magic: []byte{0x12, 0x21, 0x20, 0x11}},
	{name: "DOS partition table / boot sector", off: 510, magic: []byte{0x55, 0xaa}},
	{name: "GPT backup header", off: -512, magic: []byte("EFI PART"), fromEnd: true},
	{name: "GPT backup header (4K sectors)", off: -4096, magic: []byte("EFI PART"), fromEnd: true},
}

// Classify decides whether head (the first AreaSize bytes of a disk) and
// tail (its last AreaSize bytes, or fewer on a small disk) may be
// formatted. Anything but zeros is foreign: the known magics only give the
// operator a name for it. The lease's own header is recognised first.
func Classify(head, tail []byte) Classification {
	if len(head) >= BlockSize && string(head[0:8]) == headerMagic {
		return Classification{Layout: LayoutLease}
	}
	for _, s := range signatures {
		buf, off := head, s.off
		if s.fromEnd {
			buf, off = tail, int64(len(tail))+s.off
		}
		if off >= 0 && off+int64(len(s.magic)) <= int64(len(buf)) && bytes.Equal(buf[off:off+int64(len(s.magic))], s.magic) {
			return Classification{Layout: LayoutForeign, Signature: fmt.Sprintf("%s at byte %d", s.name, s.off)}
		}
	}
	// md 0.90 and 1.0 keep their superblock near the end.
	if len(tail) >= 64<<10 {
		for _, back := range []int{64 << 10, 8 << 10} {
			start := len(tail) - back
			start -= start % 4096
			if binary.LittleEndian.Uint32(tail[start:]) == 0xa92b4efc {
				return Classification{Layout: LayoutForeign, Signature: "MD RAID superblock near the end of the disk"}
			}
		}
	}
	if i := blank.FirstNonZero(head); i >= 0 {
		return Classification{Layout: LayoutForeign, Signature: fmt.Sprintf("non-zero data at byte %d of the first MiB", i)}
	}
	if i := blank.FirstNonZero(tail); i >= 0 {
		return Classification{Layout: LayoutForeign, Signature: fmt.Sprintf("non-zero data at byte %d of the last MiB", i)}
	}
	return Classification{Layout: LayoutBlank}
}

// ProbeBlkid asks util-linux's blkid (low-level probe, no cache) for any
// signature on path, as a second opinion that knows far more formats than
// Classify. It returns "" when blkid finds nothing (exit status 2) and
// an error when blkid cannot run. It is the blank proof's own probe
// (package internal/safety/blank).
func ProbeBlkid(ctx context.Context, path string) (string, error) {
	return blank.ProbeBlkid(ctx, path)
}
