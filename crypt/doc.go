// Package crypt holds the node's encryption stack for encrypted volumes:
// LUKS2 headers written, read and validated in Go (package crypt/luks2),
// unlocked and mapped through github.com/anatol/luks.go (Unlock), dm-crypt
// mappings grown and removed through the kernel's device-mapper ioctls
// (crypt/dmcrypt, which also maps what luks.go cannot), and the
// Vault/OpenBao transit client that wraps each volume's random passphrase
// (crypt/transit). It exists so that no node image needs cryptsetup.
package crypt
