package version

import (
	"regexp"
	"strings"
	"testing"
)

// The image of a release is tagged as its packages are versioned, so that
// an operator upgrading the agent to 1.2.3-1 knows to deploy vco-csi:1.2.3
// (a tag v1.2.3 once gave image v1.2.3 and package 1.2.3).
func TestImageTagIsThePackageVersion(t *testing.T) {
	valid := regexp.MustCompile(`^[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}$`)
	want := map[string]string{
		"v1.2.3":                  "1.2.3",
		"v1.2.3-rc1":              "1.2.3-rc1",
		"v1.2.3-4-gabc1234":       "1.2.3-git4.abc1234",
		"v1.2.3-4-gabc1234-dirty": "1.2.3-git4.abc1234.dirty",
		"6fc9a0a":                 "0.0.0-git.6fc9a0a",
	}
	for d, w := range want {
		tag, err := ImageTag(d)
		if err != nil || tag != w {
			t.Errorf("ImageTag(%q) = %q, %v; want %q", d, tag, err, w)
			continue
		}
		pkg, _ := Package(d)
		if strings.NewReplacer("~", "-", "+", "-").Replace(pkg) != tag {
			t.Errorf("%s: image %s does not read as package %s", d, tag, pkg)
		}
		if !valid.MatchString(tag) {
			t.Errorf("%s: %q is not a valid OCI tag", d, tag)
		}
	}
	if _, err := ImageTag("dev"); err == nil {
		t.Error("ImageTag(dev) gave a tag")
	}
}
