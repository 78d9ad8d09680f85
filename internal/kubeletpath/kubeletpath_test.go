package kubeletpath

import (
	"strings"
	"testing"
)

func rel(t *testing.T, p string) string {
	t.Helper()
	r, ok := strings.CutPrefix(p, "/k/")
	if !ok {
		t.Fatalf("%s is not under /k", p)
	}
	return r
}

// The builders make what the checks accept, each of its own kind only.
func TestBuiltPathsHaveTheirShape(t *testing.T) {
	staging, blockStaging := Staging("/k", "cloud.whitesky.csi", "vol-1"), BlockStaging("/k", "pv-1")
	target, blockTarget := Target("/k", "0b7c", "pv-1"), BlockTarget("/k", "pv-1", "0b7c")
	if blockStaging != "/k/plugins/kubernetes.io/csi/volumeDevices/staging/pv-1" ||
		target != "/k/pods/0b7c/volumes/kubernetes.io~csi/pv-1/mount" ||
		blockTarget != "/k/plugins/kubernetes.io/csi/volumeDevices/publish/pv-1/0b7c" {
		t.Errorf("builders: %s %s %s", blockStaging, target, blockTarget)
	}
	if !IsStaging(rel(t, staging), false) || IsStaging(rel(t, staging), true) {
		t.Errorf("%s: a filesystem staging path only", staging)
	}
	if !IsStaging(rel(t, blockStaging), true) || IsStaging(rel(t, blockStaging), false) {
		t.Errorf("%s: a block staging path only", blockStaging)
	}
	if b, ok := IsTarget(rel(t, target)); !ok || b {
		t.Errorf("%s: IsTarget = %v, %v", target, b, ok)
	}
	if b, ok := IsTarget(rel(t, blockTarget)); !ok || !b {
		t.Errorf("%s: IsTarget = %v, %v", blockTarget, b, ok)
	}
}

// The kubelet names a filesystem volume's staging directory by the
// SHA-256 of its volume handle, in hex.
func TestStagingIsNamedByTheHandlesHash(t *testing.T) {
	// printf vol-1 | sha256sum
	const want = "/k/plugins/kubernetes.io/csi/d.example/d2e8363faaac7ae76def3b14091d8eb5755f6b92e9531627aeec833a8731cc49/globalmount"
	if got := Staging("/k", "d.example", "vol-1"); got != want {
		t.Errorf("Staging = %s, want %s", got, want)
	}
}

// Everything else is refused, however close to a shape.
func TestOtherPathsAreRefused(t *testing.T) {
	for _, p := range []string{
		"", "pki", "pki/kubelet.key", "plugins_registry", "plugins_registry/x",
		"pods/u/volumes/kubernetes.io~empty-dir/x",
		"pods/u/volumes/kubernetes.io~secret/token",
		"pods/u/volumes/kubernetes.io~csi/pv",
		"pods/u/volumes/kubernetes.io~csi/pv/mount/deeper",
		"pods/u/volumes/kubernetes.io~csi/pv/vol_data.json",
		"pods/u/volumes/kubernetes.io~csi/../mount",
		"pods/../volumes/kubernetes.io~csi/pv/mount",
		"pods//volumes/kubernetes.io~csi/pv/mount",
		"pods/./volumes/kubernetes.io~csi/pv/mount",
		"pods/u",
		"plugins/kubernetes.io/csi/volumeDevices/publish/pv",
		"plugins/kubernetes.io/csi/volumeDevices/publish/pv/..",
		"plugins/kubernetes.io/csi/volumeDevices/publish/pv/u/x",
		"plugins/kubernetes.io/csi/volumeDevices/staging/pv",
		"plugins/kubernetes.io/csi/d.example/h/globalmount",
	} {
		if b, ok := IsTarget(p); ok {
			t.Errorf("IsTarget(%q) = %v, true", p, b)
		}
	}
	for _, p := range []string{
		"", "pki", "plugins_registry", "plugins/kubernetes.io/csi", "plugins/kubernetes.io/csi/d.example",
		"plugins/kubernetes.io/csi/d.example/h", "plugins/kubernetes.io/csi/d.example/h/globalmount/x",
		"plugins/kubernetes.io/csi/d.example/h/mount",
		"plugins/kubernetes.io/csi/d.example/../globalmount",
		"plugins/kubernetes.io/csi/../h/globalmount",
		"plugins/kubernetes.io/csi/Driver/h/globalmount",
		"plugins/kubernetes.io/csi/volumeDevices/publish/globalmount",
		"plugins/kubernetes.io/csi/" + strings.Repeat("d", 64) + "/h/globalmount",
		"plugins/other/csi/d.example/h/globalmount",
		"pods/u/volumes/kubernetes.io~csi/pv/mount",
	} {
		if IsStaging(p, false) {
			t.Errorf("IsStaging(%q, false) = true", p)
		}
	}
	for _, p := range []string{
		"plugins/kubernetes.io/csi/volumeDevices/staging", "plugins/kubernetes.io/csi/volumeDevices/staging/..",
		"plugins/kubernetes.io/csi/volumeDevices/staging/pv/x", "plugins/kubernetes.io/csi/volumeDevices/publish/pv",
		"plugins/kubernetes.io/csi/d.example/h/globalmount",
	} {
		if IsStaging(p, true) {
			t.Errorf("IsStaging(%q, true) = true", p)
		}
	}
}
