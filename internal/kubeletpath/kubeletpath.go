// Package kubeletpath names the paths the kubelet gives a CSI driver's node
// calls, relative to the kubelet's root directory (Kubernetes 1.34), and
// tells whether a path has one of those shapes:
//
//	staging, filesystem volume  plugins/kubernetes.io/csi/<driver>/<volume handle hash>/globalmount
//	staging, raw block volume   plugins/kubernetes.io/csi/volumeDevices/staging/<pv>
//	target, filesystem volume   pods/<pod uid>/volumes/kubernetes.io~csi/<pv>/mount
//	target, raw block volume    plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod uid>
//
// Each <...> is one path element: not empty, not "." or "..", and <driver>
// a CSI driver name (a DNS subdomain of at most 63 lowercase characters).
// The agent accepts a stage or publish only at such a path
// (docs/security.md); the builders serve tests and the lab.
package kubeletpath

import (
	"crypto/sha256"
	"encoding/hex"
	"path/filepath"
	"regexp"
	"strings"
)

// The shapes, for messages.
const (
	StagingShape      = "plugins/kubernetes.io/csi/<driver>/<volume handle hash>/globalmount"
	BlockStagingShape = "plugins/kubernetes.io/csi/volumeDevices/staging/<pv>"
	TargetShape       = "pods/<pod uid>/volumes/kubernetes.io~csi/<pv>/mount"
	BlockTargetShape  = "plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod uid>"
)

const (
	csiPlugins    = "plugins/kubernetes.io/csi"
	volumeDevices = csiPlugins + "/volumeDevices"
)

// Staging is the staging path of a filesystem volume with volume handle
// handle, staged for driver under root: the kubelet names its directory by
// the SHA-256 of the handle.
func Staging(root, driver, handle string) string {
	sum := sha256.Sum256([]byte(handle))
	return filepath.Join(root, csiPlugins, driver, hex.EncodeToString(sum[:]), "globalmount")
}

// BlockStaging is the staging path of raw block volume pv under root.
func BlockStaging(root, pv string) string {
	return filepath.Join(root, volumeDevices, "staging", pv)
}

// Target is the target path of filesystem volume pv in pod podUID.
func Target(root, podUID, pv string) string {
	return filepath.Join(root, "pods", podUID, "volumes", "kubernetes.io~csi", pv, "mount")
}

// BlockTarget is the target path of raw block volume pv in pod podUID.
func BlockTarget(root, pv, podUID string) string {
	return filepath.Join(root, volumeDevices, "publish", pv, podUID)
}

// IsStaging reports whether rel, a path relative to the kubelet root,
// is a staging path of the kind block says.
func IsStaging(rel string, block bool) bool {
	p := strings.Split(rel, "/")
	if block {
		return len(p) == 6 && strings.Join(p[:5], "/") == volumeDevices+"/staging" && element(p[5])
	}
	return len(p) == 6 && strings.Join(p[:3], "/") == csiPlugins && DriverName(p[3]) && element(p[4]) && p[5] == "globalmount"
}

// IsTarget reports whether rel, a path relative to the kubelet root, is a
// target path, and whether of a raw block volume.
func IsTarget(rel string) (block, ok bool) {
	p := strings.Split(rel, "/")
	switch {
	case len(p) == 6 && p[0] == "pods" && element(p[1]) && p[2] == "volumes" && p[3] == "kubernetes.io~csi" && element(p[4]) && p[5] == "mount":
		return false, true
	case len(p) == 7 && strings.Join(p[:5], "/") == volumeDevices+"/publish" && element(p[5]) && element(p[6]):
		return true, true
	}
	return false, false
}

// element reports whether s can stand for one path element of a shape.
func element(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsAny(s, "/\x00")
}

var driverRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$`)

// DriverName reports whether s is a CSI driver name as Kubernetes checks a
// CSIDriver's: a DNS subdomain of at most 63 lowercase characters. It
// keeps volumeDevices, the kubelet's own directory, out of <driver>.
func DriverName(s string) bool {
	return len(s) <= 63 && driverRE.MatchString(s)
}
