package inuse

import (
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

// adv24Fuse is a FUSE filesystem of one empty regular file, "f", served
// by this process; from armed on, it holds back its answer to the first
// LOOKUP of this process and says so on stalled, until release.
type adv24Fuse struct {
	dev     int
	armed   chan struct{}
	stalled chan uint64 // the unique of the LOOKUP held back
}

const (
	fuseLookup      = 1
	fuseForget      = 2
	fuseGetattr     = 3
	fuseOpen        = 14
	fuseRelease     = 18
	fuseFlush       = 25
	fuseInit        = 26
	fuseInterrupt   = 36
	fuseBatchForget = 42
)

// adv24MountFuse mounts the filesystem at dir; it is aborted and
// unmounted when the test ends.
func adv24MountFuse(t *testing.T, dir string) *adv24Fuse {
	t.Helper()
	// A descriptor of its own, blocking: the runtime's poller is not
	// woken by /dev/fuse before the mount attaches it.
	dev, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("no FUSE: %v", err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", dev)
	if err := unix.Mount("adv24", dir, "fuse", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		unix.Close(dev)
		t.Skipf("cannot mount a FUSE filesystem: %v", err)
	}
	f := &adv24Fuse{dev: dev, armed: make(chan struct{}), stalled: make(chan uint64, 1)}
	t.Cleanup(func() {
		// The filesystem's last reference gone, the connection ends and
		// the server's read fails.
		_ = unix.Unmount(dir, unix.MNT_DETACH)
	})
	go f.serve()
	return f
}

func (f *adv24Fuse) serve() {
	buf := make([]byte, 1<<20+4096)
	stalled := false
	for {
		n, err := unix.Read(f.dev, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			unix.Close(f.dev)
			return
		}
		if n < 40 {
			continue
		}
		op := binary.LittleEndian.Uint32(buf[4:])
		unique := binary.LittleEndian.Uint64(buf[8:])
		node := binary.LittleEndian.Uint64(buf[16:])
		pid := binary.LittleEndian.Uint32(buf[32:])
		var out []byte
		errno := int32(0)
		switch op {
		case fuseForget, fuseBatchForget, fuseInterrupt:
			continue
		case fuseInit:
			out = make([]byte, 64)
			binary.LittleEndian.PutUint32(out[0:], 7)     // major
			binary.LittleEndian.PutUint32(out[4:], 31)    // minor
			binary.LittleEndian.PutUint32(out[20:], 4096) // max_write
		case fuseLookup:
			if ofThisProcess(pid) && !stalled && isClosed(f.armed) {
				stalled = true
				f.stalled <- unique
				continue // answered by release
			}
			if name := strings.TrimRight(string(buf[40:n]), "\x00"); node != 1 || name != "f" {
				errno = -int32(unix.ENOENT)
				break
			}
			out = make([]byte, 40+88)
			binary.LittleEndian.PutUint64(out[0:], 2) // nodeid; generation, entry and attr validity 0
			putAttr(out[40:], 2)
		case fuseGetattr:
			out = make([]byte, 16+88)
			putAttr(out[16:], node)
		case fuseOpen:
			out = make([]byte, 16)
		case fuseRelease, fuseFlush:
		default:
			errno = -int32(unix.ENOSYS)
		}
		f.reply(unique, errno, out)
	}
}

func (f *adv24Fuse) reply(unique uint64, errno int32, out []byte) {
	hdr := make([]byte, 16, 16+len(out))
	binary.LittleEndian.PutUint32(hdr[0:], uint32(16+len(out)))
	binary.LittleEndian.PutUint32(hdr[4:], uint32(errno))
	binary.LittleEndian.PutUint64(hdr[8:], unique)
	_, _ = unix.Write(f.dev, append(hdr, out...))
}

// putAttr writes struct fuse_attr of node (1 the root, 2 the file).
func putAttr(b []byte, node uint64) {
	binary.LittleEndian.PutUint64(b[0:], node) // ino
	mode, nlink := uint32(unix.S_IFREG|0o644), uint32(1)
	if node == 1 {
		mode, nlink = unix.S_IFDIR|0o755, 2
	}
	binary.LittleEndian.PutUint32(b[60:], mode)
	binary.LittleEndian.PutUint32(b[64:], nlink)
	binary.LittleEndian.PutUint32(b[80:], 4096) // blksize
}

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// ofThisProcess reports whether the thread tid is one of this process's.
func ofThisProcess(tid uint32) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid))
	return err == nil
}

// adv24RegisterFile opens path, registers it with a ring and closes its
// own descriptor, says ready and waits.
func adv24RegisterFile(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	if _, err := newTestRing(fd); err != nil {
		return err
	}
	if err := unix.Close(fd); err != nil {
		return err
	}
	return afterReady(func() error { return nil })
}

// A process of the node registers a file of a FUSE filesystem it serves
// (any user may mount one, fusermount; a container may too) with an
// io_uring. The proof looks the ring's file up by the path fdinfo names
// (lookupIn: openat2 of the path in the process's root, then in the
// host's), and a path walk into a FUSE mount asks its server (a LOOKUP,
// to revalidate a name whose entry the server made valid for 0 s): the
// proof waits on that process's answer, for as long as it likes. The
// release guard runs the proof in the unstage (and the periodic check
// in ownInUse, the take-back of a lease) with no bound: an unstage, then
// every stage and check of the volume behind its lock, hangs on a
// process of the node. The descriptor scan states files through
// /proc/PID/fd with AT_STATX_DONT_SYNC so as never to wait on a
// filesystem's server; the path lookups of uring.go and mappings.go do.
//
// Here the server never answers the prover's LOOKUP; the test sees the
// proof waiting on it (the request arrived, the proof has not returned),
// then answers it to let the proof end.
func TestAdv24ReleaseGuardProofWaitsOnAFuseServer(t *testing.T) {
	hosttest.NeedRoot(t, "needs root for loop devices and a FUSE mount")
	disk, _, _ := unusedLoopDisk(t)
	dir := t.TempDir()
	fs := adv24MountFuse(t, dir)
	file := filepath.Join(dir, "f")
	cmd := exec.Command(os.Args[0], "-test.run", "^TestAdv24RingWriterProcess$")
	cmd.Env = append(os.Environ(), adv24Helper+"=fuse "+file+" -")
	cmd.Stderr = os.Stderr
	_, out := startHelper(t, cmd)
	line := make([]byte, 6)
	if _, err := out.Read(line); err != nil || string(line) != "ready\n" {
		t.Fatalf("the helper did not say ready: %q %v", line, err)
	}
	close(fs.armed)
	proof := make(chan error, 1)
	go func() { proof <- Disk("/sys", disk) }()
	select {
	case err := <-proof:
		t.Logf("the proof did not wait on the FUSE server: %v", err)
	case unique := <-fs.stalled:
		// The proof waits on this answer, which a hostile server never
		// gives; given here so that the test ends.
		fs.reply(unique, -int32(unix.ENOENT), nil)
		err := <-proof
		t.Fatalf("the proof over %s sent a LOOKUP to a FUSE server of the node's process %d (the path of a file registered with its io_uring) and waited for its answer, which the server may never give; it ended only once the server answered: %v", disk, cmd.Process.Pid, err)
	}
}
