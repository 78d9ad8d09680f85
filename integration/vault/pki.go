package vault

import (
	"os"

	"github.com/whitesky-cloud/vco-storage/integration/labpki"
)

// writePKI writes into dir a CA of its own (ca.crt; its key is not kept)
// and the listener's certificate and key for hosts (server.crt,
// server.key), as an operator's lab CA would issue them.
func writePKI(dir string, hosts ...string) error {
	ca, err := labpki.New(dir, "vco-lab Vault CA")
	if err != nil {
		return err
	}
	if err := ca.Issue("server", "vco-lab Vault server", nil, hosts...); err != nil {
		return err
	}
	return os.Remove(ca.Path("ca.key"))
}
