// Package mounttest cleans up after host tests that mount for real: a
// failed test can leave mounts below its temporary directory, which must
// go before the directory itself can. Imported by tests only.
package mounttest

import (
	"os"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// UnmountUnder unmounts every mount below dir, deepest first, lazily
// where a plain unmount is refused.
func UnmountUnder(dir string) {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var mps []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			mps = append(mps, f[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(mps)))
	for _, p := range mps {
		if unix.Unmount(p, 0) != nil {
			unix.Unmount(p, unix.MNT_DETACH)
		}
	}
}
