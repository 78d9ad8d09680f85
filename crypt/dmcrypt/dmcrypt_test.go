package dmcrypt

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestCryptTableParameters(t *testing.T) {
	m := Mapping{Name: "v", Device: "/dev/vdb", Offset: 16 << 20, Length: 1 << 30, Cipher: "aes-xts-plain64",
		Key: []byte{0xde, 0xad, 0xbe, 0xef}, SectorSize: 4096, AllowDiscards: true, IVTweak: 0}
	p, err := m.params()
	if err != nil {
		t.Fatal(err)
	}
	want := "aes-xts-plain64 deadbeef 0 /dev/vdb 32768 2 allow_discards sector_size:4096"
	if string(p) != want {
		t.Fatalf("table %q, want %q", p, want)
	}
	m.SectorSize, m.AllowDiscards = 512, false
	if p, _ := m.params(); string(p) != "aes-xts-plain64 deadbeef 0 /dev/vdb 32768" {
		t.Fatalf("plain table %q", p)
	}
	m.Length = 1<<30 + 512
	m.SectorSize = 4096
	if _, err := m.params(); err == nil {
		t.Fatal("a length that is not whole 4096-byte sectors was accepted")
	}
}

func TestMappingUUID(t *testing.T) {
	if got := MappingUUID("0b6c2e4e-1a5d-4b6f-9c3e-2f1d7a8b9c0d", "pvc-1"); got != "CRYPT-LUKS2-0b6c2e4e1a5d4b6f9c3e2f1d7a8b9c0d-pvc-1" {
		t.Fatal(got)
	}
}

// Holders names the mount point of a busy device: a real loop device with
// a real filesystem, mounted.
func TestHoldersNameTheMount(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for loop devices and mount")
	}
	img := filepath.Join(t.TempDir(), "fs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 8<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v %s", err, out)
	}
	out, err := exec.Command("losetup", "-f", "--show", img).Output()
	if err != nil {
		t.Fatalf("losetup: %v", err)
	}
	loop := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	mnt := filepath.Join(t.TempDir(), "mnt point")
	os.Mkdir(mnt, 0o755)
	if out, err := exec.Command("mount", loop, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	t.Cleanup(func() { unix.Unmount(mnt, 0) })
	var st unix.Stat_t
	if err := unix.Stat(loop, &st); err != nil {
		t.Fatal(err)
	}
	h := Holders(st.Rdev)
	if len(h) != 1 || h[0] != "mounted at "+mnt {
		t.Fatalf("holders %q", h)
	}
}

// Without device-mapper in the kernel (as on the build host) the error
// says so and what to do.
func TestNoDeviceMapper(t *testing.T) {
	f, err := os.OpenFile(controlPath, os.O_RDWR, 0)
	if err == nil {
		f.Close()
		t.Skip("this kernel has device-mapper; the lab tier covers the real paths")
	}
	_, err = Create(Mapping{Name: "vco-test", Device: "/dev/null", Length: 4096, Cipher: "aes-xts-plain64", Key: make([]byte, 64)})
	if err == nil || !strings.Contains(err.Error(), "device-mapper is not available") || !strings.Contains(err.Error(), "dm_crypt") {
		t.Fatalf("Create without device-mapper: %v", err)
	}
}

func TestCryptTableFields(t *testing.T) {
	b, off, sector := cryptTableFields([]byte("aes-xts-plain64 0011 0 253:16 32768 2 allow_discards sector_size:4096"))
	if b != "253:16" || off != "32768" || sector != 4096 {
		t.Fatalf("%q %q %d", b, off, sector)
	}
	if b, _, sector := cryptTableFields([]byte("aes-xts-plain64 0011 0 8:0 4096")); b != "8:0" || sector != 512 {
		t.Fatalf("%q %d", b, sector)
	}
	if b, _, _ := cryptTableFields([]byte("short")); b != "" {
		t.Fatal("a short table parsed")
	}
}
