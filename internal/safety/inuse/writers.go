package inuse

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// procRoot is where the processes of this host are listed.
const procRoot = "/proc"

// writer says which process of this host, other than this one, holds
// one of devs open for writing (a file descriptor of the device, as
// /proc/PID/task/TID/fd lists each thread's: processWriter) or maps it
// shared and writable (a mapping that outlives its descriptor, as
// /proc/PID/maps and /proc/PID/map_files list them; or one it may make
// writable: processMapper), as a sentence's object; "" when none. A process that ends while
// it is looked at holds nothing; one the kernel does not let this process
// look at (its ptrace access check: root of the host's namespaces, as the
// agent runs, passes it) is not looked at; any other failure to list a
// process's files leaves the proof unmade. The agent's own
// descriptors (its fencer's, the disk it checks) are its own to close.
// Attributes are taken from what the kernel has (AT_STATX_DONT_SYNC): a
// descriptor of a network filesystem's file does not make the proof wait
// on its server.
func writer(devs []blockDev) (string, error) {
	want := make(map[uint64]blockDev, len(devs))
	for _, d := range devs {
		var maj, min uint32
		if _, err := fmt.Sscanf(d.devnum, "%d:%d", &maj, &min); err == nil {
			want[unix.Mkdev(maj, min)] = d
		}
	}
	procs, err := os.ReadDir(procRoot)
	if err != nil {
		return "", fmt.Errorf("listing the processes of this host: %w", err)
	}
	self := os.Getpid()
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid == self {
			continue
		}
		what, err := processWriter(pid, want)
		if err != nil || what != "" {
			return what, err
		}
	}
	return "", nil
}

// processWriter says whether the process pid holds one of want open for
// writing or maps it shared and writable. Each of its threads may have a
// descriptor table of its own (unshare CLONE_FILES), which /proc/PID/fd,
// the thread group leader's, does not list; a leader that exited while
// other threads run lists none. So every thread's table is read
// (/proc/PID/task/TID/fd), but one the kernel says is a table already
// read (kcmp KCMP_FILES), as most threads share their leader's.
func processWriter(pid int, want map[uint64]blockDev) (string, error) {
	dir := filepath.Join(procRoot, strconv.Itoa(pid), "task")
	tasks, err := os.ReadDir(dir)
	if gone(err) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("listing the threads of process %d: %w", pid, err)
	}
	var read []int
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil || sharesFiles(tid, read) {
			continue
		}
		what, err := taskWriter(pid, filepath.Join(dir, t.Name()), want)
		if err != nil || what != "" {
			return what, err
		}
		read = append(read, tid)
	}
	return processMapper(pid, want)
}

// sharesFiles reports whether the kernel says the thread tid shares its
// descriptor table with one of the threads read. A kernel that cannot
// tell (kcmp refused, the thread gone) says no: the table is read.
func sharesFiles(tid int, read []int) bool {
	for _, r := range read {
		n, _, errno := unix.Syscall6(unix.SYS_KCMP, uintptr(r), uintptr(tid), kcmpFiles, 0, 0, 0)
		if errno == 0 && n == 0 {
			return true
		}
	}
	return false
}

// kcmpFiles is kcmp's KCMP_FILES: whether two tasks share a descriptor
// table.
const kcmpFiles = 2

// taskWriter says whether the thread whose /proc directory is task (of
// process pid) holds one of want open for writing.
func taskWriter(pid int, task string, want map[uint64]blockDev) (string, error) {
	fds, err := os.ReadDir(filepath.Join(task, "fd"))
	if gone(err) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("listing the open files of process %d: %w", pid, err)
	}
	for _, fd := range fds {
		var stx unix.Statx_t
		if unix.Statx(unix.AT_FDCWD, filepath.Join(task, "fd", fd.Name()), unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE, &stx) != nil ||
			uint32(stx.Mode)&unix.S_IFMT != unix.S_IFBLK {
			continue
		}
		d, ok := want[unix.Mkdev(stx.Rdev_major, stx.Rdev_minor)]
		if ok && openForWriting(task, fd.Name()) {
			return of(d, fmt.Sprintf("process %d%s holds it open for writing", pid, command(pid))), nil
		}
	}
	return "", nil
}

// processMapper says whether the process pid maps one of want shared and
// writable: a line of /proc/PID/maps whose permissions are "rw?s", its
// file stated through /proc/PID/map_files, or a shared one the process
// may make writable at any time (mprotect: "mw" among its VmFlags in
// /proc/PID/smaps, a mapping of a descriptor that was open for writing).
func processMapper(pid int, want map[uint64]blockDev) (string, error) {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "maps"))
	if gone(err) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("listing the mappings of process %d: %w", pid, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 || len(f[1]) != 4 || f[1][3] != 's' {
			continue
		}
		var stx unix.Statx_t
		if unix.Statx(unix.AT_FDCWD, filepath.Join(procRoot, strconv.Itoa(pid), "map_files", f[0]), unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE, &stx) != nil ||
			uint32(stx.Mode)&unix.S_IFMT != unix.S_IFBLK {
			continue
		}
		d, ok := want[unix.Mkdev(stx.Rdev_major, stx.Rdev_minor)]
		switch {
		case !ok:
		case f[1][1] == 'w':
			return of(d, fmt.Sprintf("process %d%s maps it shared and writable", pid, command(pid))), nil
		case mayWrite(pid, f[0]):
			return of(d, fmt.Sprintf("process %d%s maps it shared, and may make the mapping writable (it was mapped from a descriptor open for writing)", pid, command(pid))), nil
		}
	}
	return "", nil
}

// mayWrite reports whether the process pid may make its mapping at rng
// (as /proc/PID/maps spells its range) writable: "mw" among the mapping's
// VmFlags in /proc/PID/smaps. A mapping smaps does not show, or that
// cannot be read, may.
func mayWrite(pid int, rng string) bool {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "smaps"))
	if gone(err) {
		return false
	}
	if err != nil {
		return true
	}
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 0 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			in = f[0] == rng
			continue
		}
		if v, ok := strings.CutPrefix(line, "VmFlags:"); ok && in {
			return slices.Contains(strings.Fields(v), "mw")
		}
	}
	return true
}

// gone reports whether err is of a process that ended, or that the
// kernel does not let this one look at.
func gone(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH) || errors.Is(err, fs.ErrPermission)
}

// of says what, of d: of its partition when d is one.
func of(d blockDev, what string) string {
	if d.partition {
		return "its partition " + d.name + ": " + what
	}
	return what
}

// openForWriting reads the flags of the descriptor fd of the thread
// whose /proc directory is task (TASK/fdinfo/FD): whether it was opened
// for writing. One that closed since writes nothing.
func openForWriting(task, fd string) bool {
	b, err := os.ReadFile(filepath.Join(task, "fdinfo", fd))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "flags:"); ok {
			flags, err := strconv.ParseUint(strings.TrimSpace(v), 8, 64)
			return err != nil || flags&unix.O_ACCMODE != unix.O_RDONLY
		}
	}
	return true
}

// command is " (NAME)" of process pid, or "".
func command(pid int) string {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "comm"))
	if err != nil {
		return ""
	}
	return " (" + strings.TrimSpace(string(b)) + ")"
}
