// Package loopdisk names the file that stands for a cloud disk when the
// simulator's host backend keeps disks as loop-device files: the
// simulator makes it, the node plugin finds the disk's loop device by it.
package loopdisk

import (
	"path/filepath"
	"strconv"
)

// File is where disk id is kept under dir.
func File(dir string, id int64) string {
	return filepath.Join(dir, "disk-"+strconv.FormatInt(id, 10)+".img")
}
