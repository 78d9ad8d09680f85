package inuse

// Files named by path in /proc (a ring's registered files, a mapping of a
// process whose leader exited), looked up without waiting on a
// filesystem.

import (
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// resolveCached is openat2's RESOLVE_CACHED (Linux 5.12), which
// golang.org/x/sys does not name.
const resolveCached = 0x20

// lookupIn states path as seen from the directory root (its symbolic
// links resolved within root), into stx. Only what the kernel has cached
// is walked (RESOLVE_CACHED): a lookup that would ask a filesystem (a
// FUSE server, which may be the very process looked at and never answer;
// a network filesystem) fails with EAGAIN instead of waiting.
func lookupIn(root, path string, stx *unix.Statx_t) error {
	dir, err := unix.Openat2(unix.AT_FDCWD, root, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: resolveCached})
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	fd, err := unix.Openat2(dir, strings.TrimPrefix(path, "/"), &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | resolveCached})
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE|unix.STATX_INO, stx)
}

// unescapePath undoes the kernel's escapes of a path in a /proc file (a
// space, tab, newline or backslash as a backslash and three octal
// digits). A file removed since keeps the " (deleted)" the kernel adds,
// and is then not found.
func unescapePath(p string) string {
	var b strings.Builder
	for i := 0; i < len(p); i++ {
		if p[i] == '\\' && i+4 <= len(p) {
			if n, err := strconv.ParseUint(p[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(p[i])
	}
	return b.String()
}

// afterFields is what of line follows its first n fields (separated by
// spaces, as maps pads its columns): a maps line's path, which may hold
// spaces of its own.
func afterFields(line string, n int) string {
	for range n {
		line = strings.TrimLeft(line, " ")
		if i := strings.IndexByte(line, ' '); i >= 0 {
			line = line[i:]
		} else {
			return ""
		}
	}
	return strings.TrimLeft(line, " ")
}
