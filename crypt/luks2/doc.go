// Package luks2 reads and validates LUKS2 headers, and does what
// github.com/anatol/luks.go cannot: format, add and remove keyslots, write
// tokens, repair a damaged header copy, and unlock from the secondary
// header when the primary is damaged or stale (luks.go reads only the
// primary). It is written from the LUKS2 on-disk format specification
// (version 1.1.4).
//
// Every open starts here: both header copies are read and the one in use
// is validated strictly (the layout rules and key derivation bounds
// below). The unlock itself then goes through luks.go (package crypt:
// luks.Open, Device.UnsealVolume, Volume.SetupMapper) reading a Snapshot
// of the validated header, run by Unseal on the keyslots and within the
// limits this package's UnlockContext uses;
// TransitToken reads the token with luks.go's Tokens() and checks it
// against the validated header. UnlockContext, this package's own keyslot
// code, unlocks from the secondary header, for read-only mappings (luks.go
// maps every volume writable), and for keyslot edits that need the volume
// key, which luks.go keeps to itself. luks.go and cryptsetup must both
// open every volume this package formats (the interop tests).
//
// Only one layout is accepted: one crypt segment of aes-xts-plain64 with a
// 256- or 512-bit key, sector size 512..4096, luks2 keyslots with the luks1
// anti-forensic splitter and argon2i/argon2id/pbkdf2 key derivation, pbkdf2
// digests, sha256 header checksums, and no requirements, integrity or
// reencryption state. Anything else is refused before any key material is
// touched, with an error that names the device and the offending field; so
// are key derivation costs beyond fixed bounds (MaxArgonMemoryKiB and the
// others), since a header is not secret. UnlockLimits bound an unlock
// further for a caller that unlocks on others' behalf.
//
// Headers are never repaired behind the caller's back: when the primary
// header is damaged the secondary is used and the damage is reported in
// Header.Damaged; only an explicit write (Repair, or any keyslot or token
// change) rewrites both copies.
package luks2
