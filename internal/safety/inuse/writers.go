package inuse

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
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
	want := make(nodes, len(devs))
	for _, d := range devs {
		want.add(d)
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
func processWriter(pid int, want nodes) (string, error) {
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
func taskWriter(pid int, task string, want nodes) (string, error) {
	fds, err := os.ReadDir(filepath.Join(task, "fd"))
	if gone(err) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("listing the open files of process %d: %w", pid, err)
	}
	for _, fd := range fds {
		var stx unix.Statx_t
		if unix.Statx(unix.AT_FDCWD, filepath.Join(task, "fd", fd.Name()), unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE, &stx) != nil {
			continue
		}
		if d, ok := want.of(&stx); ok && openForWriting(task, fd.Name()) {
			return of(d, fmt.Sprintf("process %d%s holds it open for writing", pid, command(pid))), nil
		}
		if t := uint32(stx.Mode) & unix.S_IFMT; t != 0 && t != unix.S_IFREG {
			continue // an io_uring's descriptor is an anonymous inode: no type, or a regular file's
		}
		if what, err := ringFiles(pid, task, fd.Name(), want); err != nil || what != "" {
			return what, err
		}
	}
	return "", nil
}

// gone reports whether err is of a process that ended, or that the
// kernel does not let this one look at.
func gone(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH) || errors.Is(err, fs.ErrPermission)
}

// of says what, of d: of its partition or its SCSI generic node when d
// is one.
func of(d blockDev, what string) string {
	switch {
	case d.partition:
		return "its partition " + d.name + ": " + what
	case d.char:
		return "its SCSI generic node " + d.name + ": " + what
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
