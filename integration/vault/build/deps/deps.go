//go:build vaultdeps

// Package deps is never built: its import keeps the server's packages in
// go.mod and go.sum, so that `go build github.com/hashicorp/vault` (the
// server's main package, at the module's root) builds with -mod=readonly.
package deps

import _ "github.com/hashicorp/vault/command"
