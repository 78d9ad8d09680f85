package main

import (
	"strings"
	"testing"
)

// A URL given with user information (https://user:password@host) is
// refused, rightly: but the refusal quotes the URL whole, password and
// all, and the refusal goes to the plugin's log at start (and, for the
// key backend, to its readiness answer). The portal URL is a key of the
// Secret csi-driver-secret: whoever reads the controller's log, not the
// Secret, gets the password. A refusal names the URL without its
// password (url.URL.Redacted) or without its user information.
func TestARefusedURLsPasswordIsNotQuoted(t *testing.T) {
	const password = "hunter2-portal-password"
	raw := "https://csi:" + password + "@try.whitesky.cloud"
	if _, err := portalAPIURL(raw, false); err == nil {
		t.Errorf("portal URL %s accepted", raw)
	} else if strings.Contains(err.Error(), password) {
		t.Errorf("the refusal of the portal URL quotes its password: %v", err)
	}
	raw = "https://vault:" + password + "@openbao.example.net:8200"
	if err := checkKeyBackendAddress(raw, false); err == nil {
		t.Errorf("key backend address %s accepted", raw)
	} else if strings.Contains(err.Error(), password) {
		t.Errorf("the refusal of the key backend address quotes its password: %v", err)
	}
}
