// Package repo holds what `make repo` (make-repo.sh) makes the signed apt
// and yum repositories with, and the templates of the files nodes use
// them through: vco-storage.sources (apt, the key in Signed-By) and
// vco-storage.repo (dnf, gpgcheck and repo_gpgcheck). The package has no
// code; its tests read the templates, and, after make-repo.sh has run
// (make test-repo), check the rendered files against the repository they
// name.
package repo

// The repository's fixed names, as make-repo.sh writes them.
const (
	Suite     = "stable"
	Component = "main"
	// Keyring is the public key's file name without its extension: .gpg
	// (binary, for signed-by=) and .asc (armored).
	Keyring = "vco-storage-archive-keyring"
	// Package is the one package the repository carries.
	Package = "vco-agent"
)
