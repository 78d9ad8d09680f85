package lab

import (
	"fmt"
	"io"
	"path"
	"strings"
)

// cpioWriter writes the "newc" cpio format the kernel unpacks as an
// initramfs. It is a few lines of header formatting, written here rather
// than shelling out to cpio(1) so the archive is built from a list of
// entries without staging a directory tree. Parent directories are added
// on demand.
type cpioWriter struct {
	w    io.Writer
	ino  uint32
	dirs map[string]bool
	err  error
}

func newCpioWriter(w io.Writer) *cpioWriter {
	return &cpioWriter{w: w, ino: 1, dirs: map[string]bool{"": true, ".": true, "/": true}}
}

const (
	cpioModeDir  = 0o040000
	cpioModeFile = 0o100000
	cpioModeLink = 0o120000
)

func (c *cpioWriter) header(name string, mode uint32, nlink uint32, size int) {
	if c.err != nil {
		return
	}
	c.ino++
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, nlink, 0, size, 0, 0, 0, 0, len(name)+1, 0)
	buf := make([]byte, 0, len(hdr)+len(name)+4)
	buf = append(buf, hdr...)
	buf = append(buf, name...)
	buf = append(buf, 0)
	for len(buf)%4 != 0 {
		buf = append(buf, 0)
	}
	_, c.err = c.w.Write(buf)
}

func (c *cpioWriter) pad(n int) {
	if c.err != nil || n%4 == 0 {
		return
	}
	_, c.err = c.w.Write(make([]byte, 4-n%4))
}

func clean(name string) string {
	return strings.TrimPrefix(path.Clean("/"+name), "/")
}

// Dir adds a directory and its parents.
func (c *cpioWriter) Dir(name string, perm uint32) {
	name = clean(name)
	if c.dirs[name] {
		return
	}
	c.Dir(path.Dir(name), 0o755)
	c.dirs[name] = true
	c.header(name, cpioModeDir|perm, 2, 0)
}

// File adds a regular file with the given contents.
func (c *cpioWriter) File(name string, perm uint32, data []byte) {
	name = clean(name)
	c.Dir(path.Dir(name), 0o755)
	c.header(name, cpioModeFile|perm, 1, len(data))
	if c.err == nil {
		_, c.err = c.w.Write(data)
	}
	c.pad(len(data))
}

// Symlink adds a symbolic link name -> target.
func (c *cpioWriter) Symlink(name, target string) {
	name = clean(name)
	c.Dir(path.Dir(name), 0o755)
	c.header(name, cpioModeLink|0o777, 1, len(target))
	if c.err == nil {
		_, c.err = io.WriteString(c.w, target)
	}
	c.pad(len(target))
}

// Close writes the trailer and reports the first error.
func (c *cpioWriter) Close() error {
	c.header("TRAILER!!!", 0, 1, 0)
	return c.err
}
