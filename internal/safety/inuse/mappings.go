package inuse

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// processMapper says whether the process pid maps one of want shared and
// writable: a line of its maps whose permissions are "rw?s", or a shared
// one the process may make writable at any time (mprotect: "mw" among
// its VmFlags in smaps, a mapping of a descriptor that was open for
// writing). A mapping's file is stated through /proc/PID/map_files. A
// process whose thread group leader exited while other threads run has
// empty /proc/PID/maps and map_files (the leader has no memory any more):
// its maps are read from a thread that runs (threadMaps), and each shared
// mapping's file is looked up by the path and inode the maps line names;
// one that is not found so leaves the proof unmade.
func processMapper(pid int, want nodes) (string, error) {
	dir := filepath.Join(procRoot, strconv.Itoa(pid))
	b, err := os.ReadFile(filepath.Join(dir, "maps"))
	if gone(err) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("listing the mappings of process %d: %w", pid, err)
	}
	byPath := false
	if len(b) == 0 {
		if dir, b, err = threadMaps(pid); err != nil || len(b) == 0 {
			return "", err
		}
		byPath = true
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 || len(f[1]) != 4 || f[1][3] != 's' {
			continue
		}
		var stx unix.Statx_t
		if byPath {
			if ok, err := mappedFile(pid, dir, line, &stx); err != nil {
				return "", err
			} else if !ok {
				continue
			}
		} else if unix.Statx(unix.AT_FDCWD, filepath.Join(dir, "map_files", f[0]), unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE, &stx) != nil {
			continue
		}
		d, ok := want.of(&stx)
		switch {
		case !ok:
		case f[1][1] == 'w':
			return of(d, fmt.Sprintf("process %d%s maps it shared and writable", pid, command(pid))), nil
		case mayWrite(dir, f[0]):
			return of(d, fmt.Sprintf("process %d%s maps it shared, and may make the mapping writable (it was mapped from a descriptor open for writing)", pid, command(pid))), nil
		}
	}
	return "", nil
}

// threadMaps is the /proc directory and the maps of a thread of process
// pid that has them (one that runs: the thread group shares its memory);
// none when no thread has (the process ended, or has no memory: a kernel
// thread).
func threadMaps(pid int) (string, []byte, error) {
	tasks, err := os.ReadDir(filepath.Join(procRoot, strconv.Itoa(pid), "task"))
	if gone(err) {
		return "", nil, nil
	}
	if err != nil {
		return "", nil, fmt.Errorf("listing the threads of process %d: %w", pid, err)
	}
	for _, t := range tasks {
		dir := filepath.Join(procRoot, strconv.Itoa(pid), "task", t.Name())
		b, err := os.ReadFile(filepath.Join(dir, "maps"))
		if gone(err) {
			continue
		}
		if err != nil {
			return "", nil, fmt.Errorf("listing the mappings of process %d: %w", pid, err)
		}
		if len(b) > 0 {
			return dir, b, nil
		}
	}
	return "", nil, nil
}

// mappedFile states the file of the maps line (of the thread whose /proc
// directory is task, of process pid) into stx, found by the line's path
// in the thread's root or in this host's and taken only when its device
// and inode are the line's. A line that names no file (an anonymous shared mapping) has
// none: false. A file found in neither is an error: it may be the disk.
func mappedFile(pid int, task, line string, stx *unix.Statx_t) (bool, error) {
	f := strings.Fields(line)
	ino, err := strconv.ParseUint(f[4], 10, 64)
	if err != nil || ino == 0 {
		return false, nil
	}
	var maj, min uint32
	if _, err := fmt.Sscanf(f[3], "%x:%x", &maj, &min); err != nil {
		return false, fmt.Errorf("process %d%s: a line of its maps with device %q: %w", pid, command(pid), f[3], err)
	}
	path := unescapePath(afterFields(line, 5))
	for _, root := range []string{filepath.Join(task, "root"), "/"} {
		if lookupIn(root, path, stx) == nil && stx.Ino == ino && stx.Dev_major == maj && stx.Dev_minor == min {
			return true, nil
		}
	}
	return false, fmt.Errorf("process %d%s maps a file shared, %q, that is found neither in its root nor in this host's: it may be the disk", pid, command(pid), path)
}

// mayWrite reports whether the process whose /proc directory is dir may
// make its mapping at rng (as maps spells its range) writable: "mw"
// among the mapping's VmFlags in smaps. A mapping smaps does not show,
// or that cannot be read, may.
func mayWrite(dir, rng string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "smaps"))
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
