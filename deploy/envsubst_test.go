package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"testing"
)

// TestEnvsubstAgreesWithRender fills csi.yaml and csi-snapshots.yaml the
// way CAPVCO's tooling does, with GNU envsubst, both with the two names
// given and without any (which substitutes every variable of the
// environment), and expects Render's bytes each time.
func TestEnvsubstAgreesWithRender(t *testing.T) {
	envsubst, err := exec.LookPath("envsubst")
	if err != nil {
		if os.Getenv("VCO_DEPLOY_REQUIRE_TOOLS") != "" {
			t.Fatal("envsubst is not installed; run make deps (gettext-base)")
		}
		t.Skip("envsubst is not installed (make deps installs gettext-base)")
	}
	for _, p := range Parts() {
		envsubstPart(t, envsubst, p.FileName())
	}
}

func envsubstPart(t *testing.T, envsubst, file string) {
	tmpl, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range renderings {
		want, err := Render(tmpl, v)
		if err != nil {
			t.Fatal(err)
		}
		for _, args := range [][]string{{"${VCO_CSI_IMAGE} ${VCO_CSI_DRIVER_NAME}"}, nil} {
			cmd := exec.Command(envsubst, args...)
			cmd.Stdin = bytes.NewReader(tmpl)
			cmd.Env = []string{"VCO_CSI_IMAGE=" + v.Image, "VCO_CSI_DRIVER_NAME=" + v.DriverName,
				"HOME=/nonexistent", "VCO_PORTAL_URL=https://wrong.example", "VCO_CUSTOMER=wrong"}
			got, err := cmd.Output()
			if err != nil {
				t.Fatalf("envsubst %q < %s: %v", args, file, err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("envsubst %q < %s differs from Render for %s", args, file, v.DriverName)
			}
		}
	}
}
