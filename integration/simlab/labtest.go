package simlab

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

var (
	csiOnce sync.Once
	csiBin  string
	csiErr  error
)

// TestConfig is lab.TestConfig with the vco-csi plugin in the guests:
// from $VCO_LAB_BIN when set (make passes its bin/), otherwise built once
// per process from this module's source.
func TestConfig(dir string) (lab.Config, error) {
	cfg, err := lab.TestConfig(dir)
	if err != nil {
		return cfg, err
	}
	if d := os.Getenv("VCO_LAB_BIN"); d != "" {
		cfg.Binaries["/bin/vco-csi"] = filepath.Join(d, "vco-csi")
		return cfg, nil
	}
	csiOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		root := filepath.Join(filepath.Dir(file), "..", "..")
		d, err := os.MkdirTemp("", "vco-lab-csi-")
		if err != nil {
			csiErr = err
			return
		}
		gobin, err := exec.LookPath("go")
		if err != nil {
			gobin = "/usr/local/go/bin/go"
		}
		cmd := exec.Command(gobin, "build", "-trimpath", "-o", d+"/", "./cmd/vco-csi")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			csiErr = fmt.Errorf("building vco-csi for the guests: %w\n%s", err, out)
			return
		}
		csiBin = filepath.Join(d, "vco-csi")
	})
	if csiErr != nil {
		return cfg, csiErr
	}
	cfg.Binaries["/bin/vco-csi"] = csiBin
	return cfg, nil
}
