package luks2

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The default KDF cost is documented to fit the 256 MiB memory limit of the
// node plugin. Check it on a real process: a child unlocks a volume with
// the default cost and its peak resident size is read from the kernel.
func TestDefaultKDFFitsNodePluginMemoryLimit(t *testing.T) {
	if img := os.Getenv("VCO_LUKS2_MEMORY_CHILD"); img != "" {
		v, err := Open(img, false)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := v.Unlock([]byte("memory")); err != nil {
			t.Fatal(err)
		}
		// VmHWM belongs to this process's own address space; the rusage
		// peak would include the parent's, inherited through exec.
		status, err := os.ReadFile("/proc/self/status")
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(status), "\n") {
			if strings.HasPrefix(l, "VmHWM:") {
				fmt.Println("PEAK", strings.Fields(l)[1])
			}
		}
		return
	}
	p, v := formatImage(t, 32<<20, FormatOptions{Passphrase: []byte("memory"), KDF: DefaultKDF})
	v.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^TestDefaultKDFFitsNodePluginMemoryLimit$", "-test.count=1")
	cmd.Env = append(os.Environ(), "VCO_LUKS2_MEMORY_CHILD="+p)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v %s", err, out)
	}
	m := regexp.MustCompile(`PEAK (\d+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("child reported no peak:\n%s", out)
	}
	peakKiB, _ := strconv.ParseInt(string(m[1]), 10, 64)
	const limitKiB = 256 << 10
	t.Logf("peak RSS of an unlock at the default cost: %d MiB", peakKiB>>10)
	if peakKiB > limitKiB*3/4 {
		t.Fatalf("unlock at the default KDF cost peaks at %d MiB, too close to the 256 MiB limit", peakKiB>>10)
	}
	if peakKiB < int64(DefaultKDF.MemoryKiB) {
		t.Fatalf("peak %d KiB is below the argon2 memory cost %d KiB: the child did not run the KDF", peakKiB, DefaultKDF.MemoryKiB)
	}
}
