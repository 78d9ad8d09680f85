package driver

import (
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
)

// A failed unwrap says what the key backend's answer means and what the
// operator can do, with the key version the volume's header records; the
// stage fails with FAILED_PRECONDITION. The answers are the ones Vault
// gives (integration/vault checks them against a real server).
func TestUnwrapFailureNamesTheCauseAndTheRemedy(t *testing.T) {
	tok := &luks2.TransitToken{Mount: "transit-lab", KeyName: "vco-csi-volumes", KeyVersion: 3, Ciphertext: "vault:v3:c2VjcmV0"}
	addr := "https://vault.example:8200"
	for _, c := range []struct {
		name string
		err  error
		says []string
	}{
		{"too old", &transit.Error{Address: addr, Op: "decrypt", Key: tok.KeyName, Status: 400,
			Errors: []string{"ciphertext or signature version is disallowed by policy (too old)"}},
			[]string{"version 3 of transit key \"vco-csi-volumes\" (mount transit-lab)", "min_decryption_version to 3 or lower"}},
		{"sealed", &transit.Error{Address: addr, Op: "decrypt", Key: tok.KeyName, Status: 503, Errors: []string{"Vault is sealed"}},
			[]string{"version 3 of transit key", "the key backend is sealed: unseal it"}},
		{"unanswered", &transit.Error{Address: addr, Op: "decrypt", Key: tok.KeyName, Err: errors.New("connect: connection refused")},
			[]string{"connection refused", "did not answer: check csi-key-backend-config's address"}},
		{"login refused", &transit.Error{Address: addr, Op: `kubernetes login as role "vco-csi-node"`, Status: 403, Errors: []string{"permission denied"}},
			[]string{"refused the node plugin's login", "binds the node plugin's ServiceAccount"}},
		{"other", &transit.Error{Address: addr, Op: "decrypt", Key: tok.KeyName, Status: 500, Errors: []string{"internal error"}},
			[]string{"internal error", "check the node plugin's access"}},
	} {
		err := unwrapFailure("ch-gen-1/8", tok, c.err)
		if CodeForError(err) != codes.FailedPrecondition {
			t.Errorf("%s: code %v, want FailedPrecondition", c.name, CodeForError(err))
		}
		for _, w := range append(c.says, "volume ch-gen-1/8") {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not say %q", c.name, err, w)
			}
		}
		if strings.Contains(err.Error(), tok.Ciphertext) {
			t.Errorf("%s: %q names the wrapped passphrase", c.name, err)
		}
	}
	// 400 for another reason is not taken for a version below the minimum.
	err := unwrapFailure("v", tok, &transit.Error{Status: 400, Errors: []string{"invalid ciphertext"}})
	if strings.Contains(err.Error(), "min_decryption_version") {
		t.Errorf("a 400 of another cause: %q", err)
	}
}
