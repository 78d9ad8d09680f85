package deploy

import (
	"strings"
	"testing"
)

func TestDriverNameFromImage(t *testing.T) {
	for image, want := range map[string]string{
		"try.whitesky.cloud/vco/csi:1.0":                                    "cloud.whitesky.csi",
		"registry.try.whitesky.cloud/vco/csi:1.0":                           "cloud.whitesky.try.csi",
		"Try.Whitesky.Cloud:5000/vco/csi@sha256:" + strings.Repeat("0", 64): "cloud.whitesky.csi",
		"portal.example.org/csi":                                            "org.example.csi",
		"example.com/vco/csi":                                               "com.csi",
	} {
		got, err := DriverNameFromImage(image)
		if err != nil || got != want {
			t.Errorf("DriverNameFromImage(%q) = %q, %v; want %q", image, got, err, want)
		}
	}
	for _, image := range []string{
		"vco/csi:1.0",            // Docker Hub: no host of ours
		"csi",                    // no host at all
		"localhost:5000/vco/csi", // no domain
		"127.0.0.1:5000/vco/csi", // IP address
		"[::1]:5000/vco/csi",     // IPv6 address
		"registry:5000/vco/csi",  // single label
	} {
		if got, err := DriverNameFromImage(image); err == nil || !strings.Contains(err.Error(), DriverNameVar) {
			t.Errorf("DriverNameFromImage(%q) = %q, %v; want an error that says to set %s", image, got, err, DriverNameVar)
		}
	}
}

func TestRenderRefusesBadValues(t *testing.T) {
	tmpl := []byte("image: ${VCO_CSI_IMAGE}\nname: ${VCO_CSI_DRIVER_NAME}\n")
	good := Values{Image: "try.whitesky.cloud/vco/csi:1.0", DriverName: "cloud.whitesky.csi"}
	out, err := Render(tmpl, good)
	if err != nil || string(out) != "image: try.whitesky.cloud/vco/csi:1.0\nname: cloud.whitesky.csi\n" {
		t.Fatalf("Render = %q, %v", out, err)
	}
	for _, v := range []Values{
		{Image: "", DriverName: good.DriverName},
		{Image: "try.whitesky.cloud/vco/csi:1.0\nkind: Secret", DriverName: good.DriverName},
		{Image: "try.whitesky.cloud/vco/csi: 1.0", DriverName: good.DriverName},
		{Image: good.Image, DriverName: ""},
		{Image: good.Image, DriverName: "Cloud.Whitesky.CSI"},
		{Image: good.Image, DriverName: "cloud.whitesky.csi-"},
		{Image: good.Image, DriverName: strings.Repeat("a", 64)},
		{Image: good.Image, DriverName: "cloud whitesky"},
	} {
		if _, err := Render(tmpl, v); err == nil {
			t.Errorf("Render accepted %+v", v)
		}
	}
	if _, err := Render([]byte("a: ${VCO_CSI_IMAGE} $HOME ${OTHER}\nb: $(KUBE_VAR)\n"), good); err == nil ||
		!strings.Contains(err.Error(), "$HOME") || !strings.Contains(err.Error(), "${OTHER}") || strings.Contains(err.Error(), "KUBE_VAR") {
		t.Errorf("Render of a template with foreign references: %v", err)
	}
}

// The node pod's vco-agent gid is the packages' unless a rendering names
// another; the core bundle names it once, the other parts not at all.
func TestRenderAgentGID(t *testing.T) {
	for _, p := range Parts() {
		b, err := BundleOf(p)
		if err != nil {
			t.Fatal(err)
		}
		want := 0
		if p == Core {
			want = 1
		}
		if n := strings.Count(string(b), agentGroups); n != want {
			t.Errorf("part %s holds %q %d times, want %d", p, agentGroups, n, want)
		}
	}
	core, err := Bundle()
	if err != nil {
		t.Fatal(err)
	}
	v := Values{Image: "try.whitesky.cloud/vco/csi:1.0", DriverName: "cloud.whitesky.csi"}
	def, err := Render(core, v)
	if err != nil || !strings.Contains(string(def), "supplementalGroups: [573]") {
		t.Fatalf("Render without a gid: %v", err)
	}
	v.AgentGID = 4242
	other, err := Render(core, v)
	if err != nil || strings.Contains(string(other), "supplementalGroups: [573]") || !strings.Contains(string(other), "supplementalGroups: [4242]") {
		t.Errorf("Render with gid 4242: %v", err)
	}
	for _, c := range []struct {
		in   string
		want int64
	}{{"", AgentGID}, {"573", 573}, {"1001", 1001}} {
		if g, err := ParseAgentGID(c.in); g != c.want || err != nil {
			t.Errorf("ParseAgentGID(%q) = %d, %v; want %d", c.in, g, err, c.want)
		}
	}
	for _, bad := range []string{"0", "-1", "vco-agent", "4294967295", "5 73"} {
		if _, err := ParseAgentGID(bad); err == nil || !strings.Contains(err.Error(), AgentGIDVar) {
			t.Errorf("ParseAgentGID(%q): %v; want a refusal naming %s", bad, err, AgentGIDVar)
		}
	}
}
