// Package luks2 reads, validates, formats and unlocks LUKS2 volumes without
// cryptsetup, and edits their keyslots and tokens.
//
// The unlock path of github.com/anatol/luks.go reads only the primary header,
// does not verify what it reads beyond the checksum, and keeps the volume key
// to itself; it cannot format, add or remove keyslots, or write tokens. Every
// operation here needs at least one of those things (the volume key for a
// dm-crypt table with the secure-data flag and for adding a keyslot; the
// secondary header when the primary is damaged), so this package carries its
// own header reader and writer, validator, formatter and keyslot code. It is
// written from the LUKS2 on-disk format specification (version 1.1.4).
// luks.go stays in the tests as an independent second reader: every volume
// this package formats must also unseal with luks.go and with cryptsetup.
//
// Only one layout is accepted: one crypt segment of aes-xts-plain64 with a
// 256- or 512-bit key, sector size 512..4096, luks2 keyslots with the luks1
// anti-forensic splitter and argon2i/argon2id/pbkdf2 key derivation, pbkdf2
// digests, sha256 header checksums, and no requirements, integrity or
// reencryption state. Anything else is refused before any key material is
// touched, with an error that names the device and the offending field; so
// are key derivation costs beyond fixed bounds (MaxArgonMemoryKiB and the
// others), since a header is not secret. UnlockContext bounds an unlock
// further for a caller that unlocks on others' behalf.
//
// Headers are never repaired behind the caller's back: when the primary
// header is damaged the secondary is used and the damage is reported in
// Header.Damaged; only an explicit write (Repair, or any keyslot or token
// change) rewrites both copies.
package luks2
