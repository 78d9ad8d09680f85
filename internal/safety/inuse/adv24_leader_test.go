package inuse

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// adv24Tmpfs mounts a fresh tmpfs at dir, unmounted when the test ends.
func adv24Tmpfs(t *testing.T, dir string) {
	t.Helper()
	if err := unix.Mount("adv24", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
}

// A process maps the disk shared and writable through a node of it, vol,
// on a tmpfs of its own, closes its descriptor, and its thread group
// leader exits (the hidden writer "leader" of hidden_test.go). Then a
// second tmpfs is mounted over the first, and a regular file vol is
// made on it: it is the first file of a fresh tmpfs, as the node was of
// the other, so it has the node's inode number. The maps line still names
// the mapping ".../vol" with that inode (and the first tmpfs's device
// number, which mappedFile does not compare): mappedFile finds the
// regular file at that path, takes it for the mapping's file because the
// inode numbers agree, and the proof says nothing uses the disk. The
// process then writes the disk through its mapping.
func TestAdv24ReleaseGuardMissesALeaderlessMapperWhosePathNamesAnotherFile(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices")
	disk, _, st := unusedLoopDisk(t)
	dir := t.TempDir()
	adv24Tmpfs(t, dir)
	node := filepath.Join(dir, "vol")
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(st.Rdev)); err != nil {
		t.Fatal(err)
	}
	var nodeSt unix.Stat_t
	if err := unix.Stat(node, &nodeSt); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^$")
	cmd.Env = append(os.Environ(), hiddenHelper+"=leader "+node)
	cmd.Stderr = os.Stderr
	in, out := startHelper(t, cmd)
	lines := bufio.NewReader(out)
	if l, err := lines.ReadString('\n'); err != nil || l != "ready\n" {
		t.Fatalf("the helper did not say ready: %q %v", l, err)
	}
	// The mapping is made and the leader gone: cover the node's tmpfs.
	adv24Tmpfs(t, dir)
	if err := os.WriteFile(node, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	var decoy unix.Stat_t
	if err := unix.Stat(node, &decoy); err != nil {
		t.Fatal(err)
	}
	if decoy.Ino != nodeSt.Ino {
		t.Skipf("this kernel's tmpfs numbers inodes otherwise: %d, %d", nodeSt.Ino, decoy.Ino)
	}
	proof := Disk("/sys", disk)
	if _, err := io.WriteString(in, "go\n"); err != nil {
		t.Fatal(err)
	}
	if l, err := lines.ReadString('\n'); err != nil || l != "written\n" {
		t.Fatalf("the helper did not write: %q %v", l, err)
	}
	if got := diskHead(disk, len(hiddenMark)); string(got) != hiddenMark {
		t.Fatalf("control: the helper's write did not reach the disk: %q", got)
	}
	var e *Error
	switch {
	case proof == nil:
		t.Fatalf("process %d mapped %s shared and writable (leader exited) and wrote it after the proof, and Disk = nil: the proof must name it or be left unmade", cmd.Process.Pid, disk)
	case errors.As(proof, &e) && !strings.Contains(e.What, fmt.Sprintf("process %d", cmd.Process.Pid)):
		t.Fatalf("Disk = %v, not of the writer %d", proof, cmd.Process.Pid)
	}
	t.Logf("proof: %v", proof)
}
