package luks2

import (
	"bytes"
	"fmt"
	"io"
	"slices"
)

// Signature checks guard safety property P5: nothing is formatted over data
// this project did not create. The probe reads the first 1 MiB and the last
// 64 KiB of the device and looks for the magic of LUKS, filesystems, volume
// managers and partition tables; the list is short and conservative, and any
// other non-zero byte in the first 64 KiB is reported as unrecognised data.

// Signature is an on-disk magic at a fixed offset from the device start.
type Signature struct {
	Name   string
	Offset int
	Magic  []byte
}

var signatures = []Signature{
	{"LUKS", 0, magicPrimary},
	// The on-disk lease of fence/lease owns the start of a disk without
	// SCSI-3 reservations; LUKS2 then goes on the mapping after it, never on
	// the raw disk.
	{"vco-agent disk lease", 0, []byte("VCOLEASE")},
	{"ext2/ext3/ext4", 1024 + 56, []byte{0x53, 0xef}},
	{"xfs", 0, []byte("XFSB")},
	{"btrfs", 64<<10 + 64, []byte("_BHRfS_M")},
	{"f2fs", 1024, []byte{0x10, 0x20, 0xf5, 0xf2}},
	{"squashfs", 0, []byte("hsqs")},
	{"iso9660", 32769, []byte("CD001")},
	{"linux swap", 4096 - 10, []byte("SWAPSPACE2")},
	{"linux swap (suspended)", 4096 - 10, []byte("S1SUSPEND")},
	{"LVM2 physical volume", 512 + 24, []byte("LVM2 001")},
	{"GPT partition table", 512, []byte("EFI PART")},
	{"GPT partition table (4K sectors)", 4096, []byte("EFI PART")},
	{"DOS partition table or boot sector", 510, []byte{0x55, 0xaa}},
	{"NTFS", 3, []byte("NTFS    ")},
	{"bcache", 4096 + 24, []byte{0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba, 0x6d, 0x81}},
}

func init() {
	for _, off := range validHdrSizes {
		signatures = append(signatures, Signature{"LUKS2 secondary header", int(off), magicSecondary})
	}
}

// ExtraSignatures lets other parts of the project (an on-disk fencing
// lease, for example) add their own magic to the check. Offsets beyond the
// first 1 MiB are not probed.
var ExtraSignatures []Signature

const probeLen = 1 << 20

// DetectSignature returns a description of the first known signature or
// non-zero data found at the start of r, or "" when the probed areas are
// blank.
func DetectSignature(r io.ReaderAt, size uint64) (string, error) {
	n := min(size, probeLen)
	head := make([]byte, n)
	if _, err := r.ReadAt(head, 0); err != nil && err != io.EOF {
		return "", fmt.Errorf("read the start of the device: %w", err)
	}
	check := func(name string, off int, magic []byte) string {
		if off+len(magic) <= len(head) && bytes.Equal(head[off:off+len(magic)], magic) {
			return fmt.Sprintf("%s signature at offset %d", name, off)
		}
		return ""
	}
	for _, s := range slices.Concat(signatures, ExtraSignatures) {
		if d := check(s.Name, s.Offset, s.Magic); d != "" {
			return d, nil
		}
	}
	if size >= 64<<10 {
		// A GPT backup header sits in the last sector of the device.
		tail := make([]byte, 64<<10)
		if _, err := r.ReadAt(tail, int64(size)-int64(len(tail))); err != nil && err != io.EOF {
			return "", fmt.Errorf("read the end of the device: %w", err)
		}
		for _, ss := range []int{512, 4096} {
			if bytes.Equal(tail[len(tail)-ss:len(tail)-ss+8], []byte("EFI PART")) {
				return "GPT backup partition table at the end of the device", nil
			}
		}
	}
	first := head[:min(n, 64<<10)]
	for j, c := range first {
		if c != 0 {
			return fmt.Sprintf("unrecognised non-zero data at offset %d", j), nil
		}
	}
	return "", nil
}
