// Package crypt holds the node's encryption stack for encrypted volumes:
// LUKS2 headers written and read in Go (package crypt/luks2), dm-crypt
// mappings through the kernel's device-mapper ioctls (crypt/dmcrypt), and the
// Vault/OpenBao transit client that wraps each volume's random passphrase
// (crypt/transit). It exists so that no node image needs cryptsetup.
package crypt
