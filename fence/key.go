package fence

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
)

// KeyPrefix is the fixed first two bytes of every fence key this project
// registers ("vc"). It makes our registrations recognisable in sg_persist
// output next to keys of other software, and because it is non-zero, a key
// can never be 0 (which SPC-4 reserves for "unregister").
const KeyPrefix uint16 = 0x7663

// Key is an 8-byte persistent reservation key, shown and parsed as 0x%016x.
type Key uint64

// String returns the key as sg_persist prints it: 0x and 16 hex digits.
func (k Key) String() string { return fmt.Sprintf("0x%016x", uint64(k)) }

// Ours reports whether the key carries this project's prefix.
func (k Key) Ours() bool { return uint16(k>>48) == KeyPrefix }

// MarshalText encodes the key as String does, so JSON shows it readably.
func (k Key) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// UnmarshalText accepts what ParseKey accepts.
func (k *Key) UnmarshalText(b []byte) error {
	v, err := ParseKey(string(b))
	if err != nil {
		return err
	}
	*k = v
	return nil
}

// ParseKey reads a key in hexadecimal, with or without a leading 0x (the way
// sg_persist prints and accepts keys). Zero is rejected: it is not a key but
// the "unregister" value.
func ParseKey(s string) (Key, error) {
	t := strings.TrimPrefix(strings.TrimPrefix(strings.TrimSpace(s), "0x"), "0X")
	if t == "" || len(t) > 16 {
		return 0, fmt.Errorf("fence key %q: want up to 16 hexadecimal digits, e.g. 0x7663a1b2c3d4e5f6", s)
	}
	v, err := strconv.ParseUint(t, 16, 64)
	if err != nil {
		return 0, fmt.Errorf("fence key %q: not hexadecimal", s)
	}
	if v == 0 {
		return 0, fmt.Errorf("fence key %q: zero is not a valid reservation key", s)
	}
	return Key(v), nil
}

// CanonicalUUID returns u in the canonical lower-case 8-4-4-4-12 form, the
// exact string the key derivation hashes. Braces, a "urn:uuid:" prefix and
// upper case are accepted because firmware and APIs print UUIDs differently;
// anything that does not hold 32 hex digits in the canonical grouping is an
// error. The nil UUID and the all-ones UUID are rejected: firmware uses them
// for "not set", and keys derived from them would collide across nodes.
func CanonicalUUID(u string) (string, error) {
	s := strings.ToLower(strings.TrimSpace(u))
	s = strings.TrimPrefix(s, "urn:uuid:")
	if len(s) == 38 && s[0] == '{' && s[37] == '}' {
		s = s[1:37]
	}
	if len(s) != 36 || s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
		return "", fmt.Errorf("node UUID %q is not in the 8-4-4-4-12 form", u)
	}
	digits := strings.ReplaceAll(s, "-", "")
	raw, err := hex.DecodeString(digits)
	if err != nil || len(raw) != 16 {
		return "", fmt.Errorf("node UUID %q: not hexadecimal", u)
	}
	if digits == strings.Repeat("0", 32) || digits == strings.Repeat("f", 32) {
		return "", fmt.Errorf("node UUID %q is the firmware's \"not set\" value; it cannot identify a node", u)
	}
	return s, nil
}

// KeyFromUUID derives a node's fence key from its SMBIOS system UUID (for the
// controller: the VM's reference_id): KeyPrefix, then the first six bytes of
// SHA-256 over the canonical lower-case UUID string. Every path to a disk and
// every component (agent, CLI, controller) computes the same key for the same
// node.
func KeyFromUUID(uuid string) (Key, error) {
	c, err := CanonicalUUID(uuid)
	if err != nil {
		return 0, err
	}
	sum := sha256.Sum256([]byte(c))
	var b [8]byte
	binary.BigEndian.PutUint16(b[0:2], KeyPrefix)
	copy(b[2:8], sum[:6])
	return Key(binary.BigEndian.Uint64(b[:])), nil
}
