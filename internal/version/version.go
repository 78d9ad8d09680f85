// Package version derives the release versions from `git describe`: the
// .deb/.rpm version and the container image tag, which name the same
// release the same way (docs/upgrade.md#versions).
package version

import (
	"fmt"
	"regexp"
	"strings"
)

var (
	describeTag = regexp.MustCompile(`^v?(\d+\.\d+\.\d+)(?:-((?:rc|alpha|beta)[.0-9]*))?(?:-(\d+)-g([0-9a-f]+))?(-dirty)?$`)
	describeSHA = regexp.MustCompile(`^([0-9a-f]{4,40})(-dirty)?$`)
	// ociTag is what the OCI distribution spec allows as a tag.
	ociTag = regexp.MustCompile(`^[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}$`)
)

// Package turns `git describe --tags --always --dirty` output into a
// version that sorts correctly for both dpkg and rpm: a tag v1.2.3 gives
// 1.2.3, a pre-release tag sorts before its release (1.2.3~rc1), commits
// after a tag sort after it (1.2.3+git4.abc1234), and an untagged tree is
// 0.0.0+git.<sha>. A dirty tree gets ".dirty" so it is never mistaken for
// a clean build.
func Package(describe string) (string, error) {
	d := strings.TrimSpace(describe)
	if m := describeTag.FindStringSubmatch(d); m != nil {
		v := m[1]
		if m[2] != "" {
			v += "~" + m[2]
		}
		if m[3] != "" {
			v += "+git" + m[3] + "." + m[4]
		}
		if m[5] != "" {
			v += ".dirty"
		}
		return v, nil
	}
	if m := describeSHA.FindStringSubmatch(d); m != nil {
		v := "0.0.0+git." + m[1]
		if m[2] != "" {
			v += ".dirty"
		}
		return v, nil
	}
	return "", fmt.Errorf("version %q: want a git describe of a vX.Y.Z tag or a commit id", describe)
}

// ImageTag is the vco-csi image tag of the release whose packages carry
// Package(describe): the same string, with the two characters an OCI tag
// may not hold, '~' and '+', written '-'. A release v1.2.3 is vco-agent
// 1.2.3-1 and image vco-csi:1.2.3.
func ImageTag(describe string) (string, error) {
	v, err := Package(describe)
	if err != nil {
		return "", err
	}
	t := strings.NewReplacer("~", "-", "+", "-").Replace(v)
	if !ociTag.MatchString(t) {
		return "", fmt.Errorf("version %q gives %q, which is not a valid image tag", describe, t)
	}
	return t, nil
}
