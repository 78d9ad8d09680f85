package lab

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
)

// GuestTierEnv is the environment variable that turns the guest tier on.
// Guest tests boot QEMU guests (tens of seconds each under TCG on a
// 2-core machine), so a plain `go test ./...` skips them and `make
// test-lab` sets it.
const GuestTierEnv = "VCO_LAB"

// GuestTierEnabled reports whether guest tests should run, and if not, the
// reason to give for skipping.
func GuestTierEnabled() (bool, string) {
	if os.Getenv(GuestTierEnv) == "" {
		return false, "guest tier: boots QEMU guests; run it with 'make test-lab' (sets " + GuestTierEnv + "=1)"
	}
	return true, ""
}

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// TestBinaries returns a directory holding static vco-lab and vco-agent
// binaries for guests: $VCO_LAB_BIN if set (make passes its bin/),
// otherwise they are built once per process from this module's source.
func TestBinaries() (string, error) {
	if d := os.Getenv("VCO_LAB_BIN"); d != "" {
		return d, nil
	}
	buildOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		root := filepath.Join(filepath.Dir(file), "..", "..")
		buildDir, buildErr = os.MkdirTemp("", "vco-lab-bin-")
		if buildErr != nil {
			return
		}
		gobin, err := exec.LookPath("go")
		if err != nil {
			gobin = "/usr/local/go/bin/go"
		}
		cmd := exec.Command(gobin, "build", "-trimpath", "-o", buildDir+"/", "./cmd/vco-lab", "./cmd/vco-agent")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("building guest binaries: %w\n%s", err, out)
		}
	})
	return buildDir, buildErr
}

// TestConfig is a Config for a lab in dir whose guests carry the binaries
// TestBinaries gives and run vco-lab's exec server.
func TestConfig(dir string) (Config, error) {
	bin, err := TestBinaries()
	if err != nil {
		return Config{}, err
	}
	return Config{
		Dir: dir,
		Binaries: map[string]string{
			"/bin/vco-lab":   filepath.Join(bin, "vco-lab"),
			"/bin/vco-agent": filepath.Join(bin, "vco-agent"),
		},
		ExecServer: []string{"/bin/vco-lab", "guest-exec"},
	}, nil
}
