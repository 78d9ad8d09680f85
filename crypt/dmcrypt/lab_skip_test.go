//go:build !(lab && ignore)

package dmcrypt_test

import "testing"

// The real dm-crypt test (lab_test.go) boots a guest kernel through the
// QEMU lab in integration/lab; it is built only with -tags lab,ignore, which
// 'make test-crypt-lab' passes once the lab is in the tree.
func TestDMCryptInGuest(t *testing.T) {
	t.Skip("needs the QEMU lab (integration/lab): run 'make test-crypt-lab', which builds this package with -tags lab,ignore")
}
