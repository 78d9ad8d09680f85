package inuse

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ringTries bounds the reads of a ring's registered files that the
// kernel did not list (ringFiles), ringRetry apart.
const (
	ringTries = 20
	ringRetry = 5 * time.Millisecond
)

// ringFiles says whether the descriptor fd of the thread whose /proc
// directory is task (of process pid) is an io_uring one of whose
// registered files (io_uring_register's IORING_REGISTER_FILES) is among
// want. A registered file stays open in the ring after the process closed
// its own descriptor, and the ring's requests write it. The kernel lists
// a ring's registered files by path only, in its descriptor's fdinfo
// ("UserFiles:" then "N: PATH"), and not their access mode: a registered
// file of the disk counts as a writer. Each path is looked up both in the
// process's root (/proc/PID/root: a container's, which the kernel names
// it from) and in this host's; a path found in neither (a node removed
// since) leaves the proof unmade, as does a ring whose files the kernel
// did not list in ringTries reads (it lists them only when it can take
// the ring's lock at once).
func ringFiles(pid int, task, fd string, want nodes) (string, error) {
	if l, err := os.Readlink(filepath.Join(task, "fd", fd)); err != nil || l != "anon_inode:[io_uring]" {
		return "", nil
	}
	for try := 1; ; try++ {
		b, err := os.ReadFile(filepath.Join(task, "fdinfo", fd))
		if gone(err) {
			return "", nil
		}
		if err != nil {
			return "", fmt.Errorf("reading the io_uring of process %d: %w", pid, err)
		}
		paths, listed := registered(string(b))
		if listed {
			return ringHolds(pid, paths, want)
		}
		if try == ringTries {
			return "", fmt.Errorf("process %d%s has an io_uring whose registered files the kernel did not list in %d reads (the ring was busy); one may be the disk", pid, command(pid), ringTries)
		}
		time.Sleep(ringRetry)
	}
}

// ringHolds says whether one of the registered files at paths (of a ring
// of process pid) is among want.
func ringHolds(pid int, paths []string, want nodes) (string, error) {
	for _, p := range paths {
		if strings.HasSuffix(p, deleted) {
			// Its name is gone, and what has that name now (a file
			// made since) says nothing of it.
			return "", fmt.Errorf("process %d%s has a file registered with an io_uring whose name was removed, %q: it may be the disk", pid, command(pid), p)
		}
		found := false
		var lerr error
		for _, root := range []string{filepath.Join(procRoot, strconv.Itoa(pid), "root"), "/"} {
			var stx unix.Statx_t
			if err := lookupIn(root, p, &stx); err != nil {
				lerr = err
				continue
			}
			found = true
			if d, ok := want.of(&stx); ok {
				return of(d, fmt.Sprintf("process %d%s has it registered with an io_uring (%s), which may write it", pid, command(pid), p)), nil
			}
		}
		if !found {
			return "", fmt.Errorf("process %d%s has a file registered with an io_uring, %q, that is found neither in its root nor in this host's (%v): it may be the disk", pid, command(pid), p, lerr)
		}
	}
	return "", nil
}

// deleted is what the kernel adds to the path of a file whose name was
// removed.
const deleted = " (deleted)"

// registered reads a ring's fdinfo: the paths of its registered files,
// and whether the kernel listed them (a "UserFiles:" line, with an entry
// for each file unless it says 0). A ring with registered slots and no
// entry is not listed: the kernel prints the entries only when it holds
// the ring's lock (a table of empty slots, registered sparse, reads the
// same, and is read until ringTries gives up).
func registered(fdinfo string) ([]string, bool) {
	var paths []string
	count, in := -1, false
	for _, line := range strings.Split(fdinfo, "\n") {
		if v, ok := strings.CutPrefix(line, "UserFiles:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				return nil, false
			}
			count, in = n, true
			continue
		}
		if !in {
			continue
		}
		idx, p, ok := strings.Cut(strings.TrimLeft(line, " \t"), ": ")
		if _, err := strconv.Atoi(idx); !ok || err != nil {
			in = false
			continue
		}
		paths = append(paths, unescapePath(p))
	}
	return paths, count == 0 || len(paths) > 0
}
