package drivername

import "testing"

func TestFromPortal(t *testing.T) {
	for in, want := range map[string]string{
		"try.whitesky.cloud":     "cloud.whitesky.csi",
		"portal.example.com:443": "com.example.csi",
		"cloud.acme.co.uk":       "uk.co.acme.csi",
		"Try.WhiteSky.Cloud.":    "cloud.whitesky.csi",
		"10.0.0.1":               "",
		"[::1]:443":              "",
		"localhost":              "",
	} {
		if got := FromPortal(in); got != want {
			t.Errorf("FromPortal(%q) = %q, want %q", in, got, want)
		}
	}
}
