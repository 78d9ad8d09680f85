package inuse

// Directed reproductions, twenty-fourth adversarial round, of the proof's
// io_uring reading (uring.go): writers of the disk through a ring whose
// write lands after the proof said nothing uses the disk. On this host's
// loop devices (root, else skipped).

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// adv24Helper, set in the environment to "KIND DISK DIR", makes this test
// binary a writer of TestAdv24ReleaseGuardMissesARingWriter.
const adv24Helper = "INUSE_ADV24_HELPER"

func TestAdv24RingWriterProcess(t *testing.T) {
	var kind, disk, dir string
	if _, err := fmt.Sscan(os.Getenv(adv24Helper), &kind, &disk, &dir); err != nil {
		t.Skip("the helper process of TestAdv24ReleaseGuardMissesARingWriter")
	}
	// A registered ring descriptor is the registering thread's own.
	runtime.LockOSThread()
	var err error
	switch kind {
	case "deleted-node":
		err = adv24DeletedNode(disk, dir)
	case "fuse":
		err = adv24RegisterFile(disk)
	default:
		err = fmt.Errorf("unknown helper kind %q", kind)
	}
	var errno unix.Errno
	if errors.As(err, &errno) && (errno == unix.EINVAL || errno == unix.ENOSYS || errno == unix.EOPNOTSUPP || errno == unix.EPERM) {
		fmt.Println("unsupported:", err) // this kernel has not the feature: the test skips
		return
	}
	if err != nil {
		t.Fatal(err)
	}
}

// adv24DeletedNode opens the disk through a node of its own in dir,
// registers it with a ring, removes the node and puts a regular file
// where the kernel's fdinfo now names the ring's file ("NODE (deleted)").
func adv24DeletedNode(disk, dir string) error {
	var st unix.Stat_t
	if err := unix.Stat(disk, &st); err != nil {
		return err
	}
	node := filepath.Join(dir, "vol")
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(st.Rdev)); err != nil {
		return err
	}
	fd, err := unix.Open(node, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	r, err := newTestRing(fd)
	if err != nil {
		return err
	}
	if err := unix.Close(fd); err != nil {
		return err
	}
	if err := unix.Unlink(node); err != nil {
		return err
	}
	if err := os.WriteFile(node+" (deleted)", nil, 0o600); err != nil {
		return err
	}
	return afterReady(r.write)
}

// A process writes the disk through an io_uring whose registered file
// holds it, its own descriptor of the disk closed, and the write lands
// after the proof (deleted-node): the disk was opened through a node the
// process made and then removed, and a regular file now sits at the path
// the kernel names the ring's file by, "/DIR/vol (deleted)". A path is
// not the file, and the ring's fdinfo gives nothing else (no device
// number, no inode): the proof must name the process or be left unmade.
// (A ring whose own descriptor was registered and closed,
// IORING_REGISTER_RING_FDS, is listed by no table of the process: a limit
// of the proof docs/architecture.md states.)
func TestAdv24ReleaseGuardMissesARingWriter(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices")
	for _, kind := range []string{"deleted-node"} {
		t.Run(kind, func(t *testing.T) {
			disk, _, _ := unusedLoopDisk(t)
			dir := t.TempDir()
			cmd := exec.Command(os.Args[0], "-test.run", "^TestAdv24RingWriterProcess$")
			cmd.Env = append(os.Environ(), adv24Helper+"="+kind+" "+disk+" "+dir)
			cmd.Stderr = os.Stderr
			in, out := startHelper(t, cmd)
			lines := bufio.NewReader(out)
			first, _ := lines.ReadString('\n')
			if strings.HasPrefix(first, "unsupported") {
				t.Skipf("%s: %s", kind, first)
			}
			proof := proofBeforeWrite(t, disk, in, io.MultiReader(strings.NewReader(first), lines), "ready", hiddenMark)
			var e *Error
			if !errors.As(proof, &e) || !strings.Contains(e.What, fmt.Sprintf("process %d", cmd.Process.Pid)) {
				if proof == nil {
					t.Fatalf("process %d (%s) wrote %s through an io_uring after the proof, and Disk = nil: the proof must name it or be left unmade", cmd.Process.Pid, kind, disk)
				}
				t.Logf("the proof was left unmade: %v", proof)
				return
			}
			t.Logf("found: %v", proof)
		})
	}
}
