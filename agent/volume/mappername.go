package volume

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
)

// mapperNameMax bounds a dm-crypt mapping name below the kernel's
// DM_NAME_LEN (128 bytes with its terminating NUL).
const mapperNameMax = 120

// mapperName is the dm-crypt mapping name of a volume's LUKS2 volume. Two
// volumes never share one, since everything that closes a mapping closes
// it by name: every byte other than [A-Za-z0-9.-] is escaped as _xx (two
// lower-case hex digits, "_" itself included), so the escaped form names
// its volume alone; an id whose escaped form is too long keeps a prefix of
// it and appends "_h" and a SHA-256 of the whole id, a marker no escaped
// form contains.
func mapperName(volume string) string {
	var b strings.Builder
	b.WriteString("vco-")
	for i := 0; i < len(volume); i++ {
		c := volume[i]
		if c == '-' || c == '.' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "_%02x", c)
		}
	}
	s := b.String()
	if len(s) <= mapperNameMax {
		return s
	}
	sum := sha256.Sum256([]byte(volume))
	h := "_h" + hex.EncodeToString(sum[:20])
	return s[:mapperNameMax-len(h)] + h
}

// mapperOf is the name of the dm-crypt mapping c has open: the one its
// record names (an earlier agent version named mappings otherwise), else
// the name a stage of c opens it under. The release guard's proof looks
// for a mapping by this name.
func mapperOf(c *Claim) string {
	if name, ok := strings.CutPrefix(c.Mapper, "/dev/mapper/"); ok && name != "" && !strings.Contains(name, "/") {
		return name
	}
	return mapperName(c.Volume)
}

// mapperToClose is the name under which c's mapping is closed or grown:
// mapperOf, unless that is a name an earlier version recorded which is
// now another claimed volume's own; then the volume's own name (the
// earlier mapping, if still open, holds the disk, and the release guard
// keeps the fence for it).
func (m *Manager) mapperToClose(c *Claim) string {
	name := mapperOf(c)
	if name == mapperName(c.Volume) {
		return name
	}
	cs, _ := m.store.List()
	for _, o := range cs {
		if o.Volume != c.Volume && mapperName(o.Volume) == name {
			return mapperName(c.Volume)
		}
	}
	return name
}
