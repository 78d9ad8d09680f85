package luks2

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
)

// U64 is an unsigned 64-bit number that LUKS2 stores as a JSON string
// (offsets and sizes), because JSON numbers are not exact beyond 2^53.
type U64 uint64

// MarshalJSON writes the number as a decimal string.
func (u U64) MarshalJSON() ([]byte, error) {
	return json.Marshal(strconv.FormatUint(uint64(u), 10))
}

// UnmarshalJSON accepts only a decimal string.
func (u *U64) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("expected a number in a string, got %s", b)
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return fmt.Errorf("expected a number in a string, got %q", s)
	}
	*u = U64(v)
	return nil
}

// Metadata is the JSON area (spec §3). Only the fields of the layout this
// package supports exist here; the validator refuses anything else.
type Metadata struct {
	Keyslots map[string]*Keyslot        `json:"keyslots"`
	Tokens   map[string]json.RawMessage `json:"tokens"`
	Segments map[string]*Segment        `json:"segments"`
	Digests  map[string]*Digest         `json:"digests"`
	Config   Config                     `json:"config"`
}

// Keyslot is one luks2 keyslot.
type Keyslot struct {
	Type     string `json:"type"`
	KeySize  int    `json:"key_size"`
	AF       AF     `json:"af"`
	Area     Area   `json:"area"`
	KDF      KDF    `json:"kdf"`
	Priority *int   `json:"priority,omitempty"`
}

// AF is the anti-forensic splitter of a keyslot.
type AF struct {
	Type    string `json:"type"`
	Stripes int    `json:"stripes"`
	Hash    string `json:"hash"`
}

// Area is where a keyslot's encrypted key material lives.
type Area struct {
	Type       string `json:"type"`
	Offset     U64    `json:"offset"`
	Size       U64    `json:"size"`
	Encryption string `json:"encryption"`
	KeySize    int    `json:"key_size"`
}

// KDF turns a passphrase into the key of a keyslot area.
type KDF struct {
	Type       string `json:"type"`
	Hash       string `json:"hash,omitempty"`
	Iterations int    `json:"iterations,omitempty"`
	Time       int    `json:"time,omitempty"`
	Memory     int    `json:"memory,omitempty"`
	CPUs       int    `json:"cpus,omitempty"`
	Salt       []byte `json:"salt"`
}

// Segment is the encrypted data area.
type Segment struct {
	Type       string          `json:"type"`
	Offset     U64             `json:"offset"`
	Size       string          `json:"size"`
	IVTweak    U64             `json:"iv_tweak"`
	Encryption string          `json:"encryption"`
	SectorSize int             `json:"sector_size"`
	Integrity  json.RawMessage `json:"integrity,omitempty"`
	Flags      []string        `json:"flags,omitempty"`
}

// Digest verifies a volume key recovered from a keyslot.
type Digest struct {
	Type       string   `json:"type"`
	Keyslots   []string `json:"keyslots"`
	Segments   []string `json:"segments"`
	Hash       string   `json:"hash"`
	Iterations int      `json:"iterations"`
	Salt       []byte   `json:"salt"`
	Digest     []byte   `json:"digest"`
}

// Config holds the device-wide settings.
type Config struct {
	JSONSize     U64             `json:"json_size"`
	KeyslotsSize U64             `json:"keyslots_size"`
	Flags        []string        `json:"flags,omitempty"`
	Requirements json.RawMessage `json:"requirements,omitempty"`
}

// What this package accepts.
const (
	cipherXTS   = "aes-xts-plain64"
	afStripes   = 4000
	maxKeyslots = 32
	maxTokens   = 32
)

// Bounds on what a header may ask the key derivation to spend. The header
// is not secret and anyone who can write a disk can write one, so without
// them a header asking for 2^30 passes or iterations would keep whoever
// unlocks it busy for years, and one asking for 4 GiB of argon2 memory
// would take that from the node. Each bound lies well above what this
// package and cryptsetup choose with their defaults (docs/encryption.md,
// "Bounds on the key derivation", gives the figures), so that no genuine
// header is refused; a header above a bound is refused by name before any
// key derivation runs.
const (
	// MaxArgonMemoryKiB is the argon2 memory bound: cryptsetup's default
	// ceiling (it benchmarks up to 1 GiB), 16 times this package's default.
	MaxArgonMemoryKiB = 1 << 20
	// MaxArgonThreads bounds argon2 lanes (cryptsetup uses at most 4 by
	// default); lanes add goroutines, not work.
	MaxArgonThreads = 16
	// MaxArgonTime bounds the argon2 passes whatever the memory.
	MaxArgonTime = 4096
	// MaxArgonWorkKiB bounds time × memory, the work of an argon2
	// derivation in KiB-passes: 32 passes over 1 GiB. cryptsetup's 2 s
	// benchmark settles on 4 to 8 passes over 1 GiB on fast hardware.
	MaxArgonWorkKiB = 32 << 20
	// MaxPBKDF2Blocks bounds a keyslot's pbkdf2 work: iterations times
	// the hash blocks of the derived key. cryptsetup's 2 s benchmark
	// gives at most about 16 million on fast hardware (sha256, 32-byte
	// key); this package's default is 2 million (1,000,000 iterations of
	// sha256 for a 64-byte key).
	MaxPBKDF2Blocks = 1 << 26
	// MaxDigestBlocks bounds the digest's pbkdf2 work the same way; the
	// digest runs for every keyslot tried. cryptsetup benchmarks it at
	// 1/16 of the keyslot's time (about a million iterations on fast
	// hardware); this package uses 100,000.
	MaxDigestBlocks = 1 << 24
	// maxDigestLen is the longest digest any supported hash produces in
	// one block; a longer one would multiply the digest's work.
	maxDigestLen = 64
)

// What an operator can do about a refused cost: a keyslot's can be
// replaced, the digest's only by a new volume key.
const (
	keyslotCostAdvice = "if the header is genuine, open the volume with cryptsetup, add a keyslot with a lower cost (luksAddKey with --pbkdf-memory, --iter-time or --pbkdf-force-iterations) and remove this one; a header nobody here wrote may be hostile: do not unlock it"
	digestCostAdvice  = "if the header is genuine, give the volume a new volume key and digest with cryptsetup reencrypt, or copy its data to a new volume; a header nobody here wrote may be hostile: do not unlock it"
)

func tooCostly(field, advice, format string, args ...any) error {
	return invalid(field, "%s; %s", fmt.Sprintf(format, args...), advice)
}

// hashLen is the output size of a supported hash, in bytes.
func hashLen(h string) int {
	switch h {
	case "sha1":
		return 20
	case "sha256":
		return 32
	case "sha512":
		return 64
	}
	return 0
}

// pbkdf2Blocks is how many hash blocks pbkdf2 computes per iteration to
// derive keyLen bytes with hash h.
func pbkdf2Blocks(h string, keyLen int) int {
	n := hashLen(h)
	if n == 0 {
		return 1 // an unsupported hash, refused on its own
	}
	return max(1, (keyLen+n-1)/n)
}

func hashSupported(h string) bool {
	return h == "sha1" || h == "sha256" || h == "sha512"
}

// ValidationError says which part of the metadata is refused and why.
type ValidationError struct {
	Field  string
	Reason string
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("unsupported or invalid LUKS2 metadata: %s: %s", e.Field, e.Reason)
}

func invalid(field, format string, args ...any) error {
	return &ValidationError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// parseMetadata decodes and validates the JSON area of a header copy of
// size hdrSize. It first looks at the generic shape so that refusals for
// the features an attacker or a newer cryptsetup may put there (requirements,
// integrity, reencryption, more segments) name the feature, then decodes
// strictly: an unknown field anywhere is refused too.
func parseMetadata(raw []byte, hdrSize uint64) (*Metadata, error) {
	if err := noDuplicateKeys(raw); err != nil {
		return nil, err
	}
	var generic struct {
		Segments map[string]map[string]json.RawMessage `json:"segments"`
		Config   map[string]json.RawMessage            `json:"config"`
		Keyslots map[string]map[string]json.RawMessage `json:"keyslots"`
	}
	if err := json.Unmarshal(raw, &generic); err != nil {
		return nil, invalid("json", "%v", err)
	}
	if req, ok := generic.Config["requirements"]; ok && !emptyRequirements(req) {
		return nil, invalid("config.requirements", "requirements %s are not supported (reencryption or a newer LUKS2 feature in progress); use cryptsetup on this device", req)
	}
	if len(generic.Segments) != 1 {
		return nil, invalid("segments", "%d segments, exactly one is supported", len(generic.Segments))
	}
	for id, s := range generic.Segments {
		if _, ok := s["integrity"]; ok {
			return nil, invalid("segments."+id+".integrity", "authenticated encryption (dm-integrity) is not supported")
		}
	}
	for id, k := range generic.Keyslots {
		var t string
		_ = json.Unmarshal(k["type"], &t)
		if t != "luks2" {
			return nil, invalid("keyslots."+id+".type", "keyslot type %q is not supported", t)
		}
	}

	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var m Metadata
	if err := dec.Decode(&m); err != nil {
		return nil, invalid("json", "%v", err)
	}
	if err := m.validate(hdrSize); err != nil {
		return nil, err
	}
	return &m, nil
}

// noDuplicateKeys refuses JSON objects that repeat a key: parsers differ
// on which copy wins, so such a header could mean one thing to cryptsetup
// and another here. Nesting deeper than any LUKS2 header needs is refused
// too.
func noDuplicateKeys(raw []byte) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	return checkJSONValue(dec, "", 0)
}

func checkJSONValue(dec *json.Decoder, path string, depth int) error {
	if depth > 16 {
		return invalid(path, "JSON nested too deeply")
	}
	tok, err := dec.Token()
	if err != nil {
		return invalid("json", "%v", err)
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return nil
	}
	switch d {
	case '{':
		seen := map[string]bool{}
		for dec.More() {
			kt, err := dec.Token()
			if err != nil {
				return invalid("json", "%v", err)
			}
			k, _ := kt.(string)
			p := k
			if path != "" {
				p = path + "." + k
			}
			if seen[k] {
				return invalid(p, "key appears more than once")
			}
			seen[k] = true
			if err := checkJSONValue(dec, p, depth+1); err != nil {
				return err
			}
		}
	case '[':
		for i := 0; dec.More(); i++ {
			if err := checkJSONValue(dec, fmt.Sprintf("%s[%d]", path, i), depth+1); err != nil {
				return err
			}
		}
	}
	if _, err := dec.Token(); err != nil {
		return invalid("json", "%v", err)
	}
	return nil
}

func emptyRequirements(raw json.RawMessage) bool {
	var arr []string
	if json.Unmarshal(raw, &arr) == nil {
		return len(arr) == 0
	}
	var obj map[string]json.RawMessage
	if json.Unmarshal(raw, &obj) != nil {
		return false
	}
	for k, v := range obj {
		if k != "mandatory" || json.Unmarshal(v, &arr) != nil || len(arr) != 0 {
			return false
		}
	}
	return true
}

func slotID(s string) (int, bool) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || strconv.Itoa(n) != s {
		return 0, false
	}
	return n, true
}

// validate checks the decoded metadata against the one layout supported:
// its config, its one segment, its one digest, its keyslots and tokens.
func (m *Metadata) validate(hdrSize uint64) error {
	if m.Keyslots == nil || m.Tokens == nil || m.Segments == nil || m.Digests == nil {
		return invalid("json", "keyslots, tokens, segments and digests objects are mandatory")
	}
	c := m.Config
	if uint64(c.JSONSize) != hdrSize-binHeaderSize {
		return invalid("config.json_size", "%d does not match header size %d", c.JSONSize, hdrSize)
	}
	if c.KeyslotsSize%4096 != 0 {
		return invalid("config.keyslots_size", "%d is not a multiple of 4096", c.KeyslotsSize)
	}
	areaStart := 2 * hdrSize
	areaEnd := areaStart + uint64(c.KeyslotsSize)
	if err := m.validateSegment(areaEnd); err != nil {
		return err
	}
	if err := m.validateDigests(); err != nil {
		return err
	}
	if err := m.validateKeyslots(areaStart, areaEnd); err != nil {
		return err
	}
	return m.validateTokens()
}

// validateSegment checks the one segment, "0": an aes-xts crypt segment
// whose data starts past the header and keyslot areas (which end at
// areaEnd).
func (m *Metadata) validateSegment(areaEnd uint64) error {
	seg, ok := m.Segments["0"]
	if !ok {
		return invalid("segments", "the segment must be named \"0\"")
	}
	if seg.Type != "crypt" {
		return invalid("segments.0.type", "%q, only crypt is supported", seg.Type)
	}
	if seg.Encryption != cipherXTS {
		return invalid("segments.0.encryption", "cipher %q is not supported (only %s)", seg.Encryption, cipherXTS)
	}
	if len(seg.Flags) != 0 {
		return invalid("segments.0.flags", "segment flags %v are not supported", seg.Flags)
	}
	switch seg.SectorSize {
	case 512, 1024, 2048, 4096:
	default:
		return invalid("segments.0.sector_size", "%d is not one of 512, 1024, 2048, 4096", seg.SectorSize)
	}
	if uint64(seg.Offset)%uint64(seg.SectorSize) != 0 || seg.Offset%512 != 0 {
		return invalid("segments.0.offset", "%d is not aligned to the sector size %d", seg.Offset, seg.SectorSize)
	}
	if uint64(seg.Offset) < areaEnd {
		return invalid("segments.0.offset", "data offset %d overlaps the header and keyslot areas ending at %d", seg.Offset, areaEnd)
	}
	if seg.Size != "dynamic" {
		n, err := strconv.ParseUint(seg.Size, 10, 64)
		if err != nil || n == 0 || n%uint64(seg.SectorSize) != 0 {
			return invalid("segments.0.size", "%q is neither \"dynamic\" nor a positive multiple of the sector size", seg.Size)
		}
	}
	return nil
}

// validateDigests checks the one digest: pbkdf2 at a bounded cost, over
// segment 0, binding every keyslot.
func (m *Metadata) validateDigests() error {
	if len(m.Digests) != 1 {
		return invalid("digests", "%d digests, exactly one is supported", len(m.Digests))
	}
	for id, d := range m.Digests {
		if d.Type != "pbkdf2" {
			return invalid("digests."+id+".type", "digest type %q is not supported", d.Type)
		}
		if !hashSupported(d.Hash) {
			return invalid("digests."+id+".hash", "hash %q is not supported", d.Hash)
		}
		if len(d.Salt) == 0 || len(d.Digest) < 16 {
			return invalid("digests."+id, "salt or digest missing or too short")
		}
		if err := d.validateCost("digests." + id); err != nil {
			return err
		}
		if len(d.Segments) != 1 || d.Segments[0] != "0" {
			return invalid("digests."+id+".segments", "%v, the digest must cover segment 0 only", d.Segments)
		}
		if len(d.Keyslots) != len(m.Keyslots) {
			return invalid("digests."+id+".keyslots", "%v does not list every keyslot (unbound keyslots are not supported)", d.Keyslots)
		}
		for _, k := range d.Keyslots {
			if _, ok := m.Keyslots[k]; !ok {
				return invalid("digests."+id+".keyslots", "keyslot %q does not exist", k)
			}
		}
	}
	return nil
}

// keyslotSpan is where a keyslot's key material lies, [start, end).
type keyslotSpan struct {
	id         string
	start, end uint64
}

// validateKeyslots checks every keyslot, that they agree on the volume
// key size, and that their areas lie in [areaStart, areaEnd) without
// overlapping.
func (m *Metadata) validateKeyslots(areaStart, areaEnd uint64) error {
	if len(m.Keyslots) == 0 {
		return invalid("keyslots", "no keyslot: the volume cannot be unlocked")
	}
	var spans []keyslotSpan
	keySize := 0
	for id, k := range m.Keyslots {
		if err := k.validate(id, keySize, areaStart, areaEnd); err != nil {
			return err
		}
		keySize = k.KeySize
		spans = append(spans, keyslotSpan{id, uint64(k.Area.Offset), uint64(k.Area.Offset + k.Area.Size)})
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].start < spans[j].start })
	for i := 1; i < len(spans); i++ {
		if spans[i].start < spans[i-1].end {
			return invalid("keyslots", "areas of keyslots %s and %s overlap", spans[i-1].id, spans[i].id)
		}
	}
	return nil
}

// validate checks keyslot id: its name, its key size (keySize, that of
// the keyslots checked before it, or 0), splitter, area within
// [areaStart, areaEnd), key derivation and priority.
func (k *Keyslot) validate(id string, keySize int, areaStart, areaEnd uint64) error {
	f := "keyslots." + id
	if n, ok := slotID(id); !ok || n >= maxKeyslots {
		return invalid(f, "keyslot name must be a number below %d", maxKeyslots)
	}
	if k.KeySize != 32 && k.KeySize != 64 {
		return invalid(f+".key_size", "%d bytes, only 32 or 64 (aes-xts 256/512 bit) are supported", k.KeySize)
	}
	if keySize != 0 && k.KeySize != keySize {
		return invalid(f+".key_size", "keyslots disagree on the volume key size")
	}
	if k.AF.Type != "luks1" || k.AF.Stripes != afStripes || !hashSupported(k.AF.Hash) {
		return invalid(f+".af", "%+v, only luks1 with %d stripes and sha1/sha256/sha512 is supported", k.AF, afStripes)
	}
	if err := k.Area.validate(f+".area", uint64(k.KeySize*afStripes), areaStart, areaEnd); err != nil {
		return err
	}
	if err := k.KDF.validate(f+".kdf", k.Area.KeySize); err != nil {
		return err
	}
	if k.Priority != nil && (*k.Priority < 0 || *k.Priority > 2) {
		return invalid(f+".priority", "%d is not 0, 1 or 2", *k.Priority)
	}
	return nil
}

// validate checks a keyslot's area f: raw aes-xts, large enough for need
// bytes of key material, within the keyslots area [areaStart, areaEnd).
func (a *Area) validate(f string, need, areaStart, areaEnd uint64) error {
	if a.Type != "raw" || a.Encryption != cipherXTS {
		return invalid(f, "type %q encryption %q, only raw %s is supported", a.Type, a.Encryption, cipherXTS)
	}
	if a.KeySize != 32 && a.KeySize != 64 {
		return invalid(f+".key_size", "%d bytes is not an aes-xts key size", a.KeySize)
	}
	if uint64(a.Size) < need || a.Offset%512 != 0 {
		return invalid(f, "size %d offset %d cannot hold %d bytes of key material", a.Size, a.Offset, need)
	}
	if uint64(a.Offset) < areaStart || uint64(a.Offset)+uint64(a.Size) > areaEnd {
		return invalid(f, "[%d, %d) lies outside the keyslots area [%d, %d)", a.Offset, a.Offset+a.Size, areaStart, areaEnd)
	}
	return nil
}

// validateTokens checks every token's name, type and keyslots.
func (m *Metadata) validateTokens() error {
	if len(m.Tokens) > maxTokens {
		return invalid("tokens", "%d tokens, at most %d", len(m.Tokens), maxTokens)
	}
	for id, raw := range m.Tokens {
		if n, ok := slotID(id); !ok || n >= maxTokens {
			return invalid("tokens."+id, "token name must be a number below %d", maxTokens)
		}
		var t struct {
			Type     string   `json:"type"`
			Keyslots []string `json:"keyslots"`
		}
		if err := json.Unmarshal(raw, &t); err != nil || t.Type == "" || t.Keyslots == nil {
			return invalid("tokens."+id, "a token needs a type and a keyslots array")
		}
		for _, k := range t.Keyslots {
			if _, ok := m.Keyslots[k]; !ok {
				return invalid("tokens."+id+".keyslots", "keyslot %q does not exist", k)
			}
		}
	}
	return nil
}

// validateCost checks the digest's pbkdf2 work against MaxDigestBlocks.
func (d *Digest) validateCost(f string) error {
	if len(d.Digest) > maxDigestLen {
		return invalid(f+".digest", "%d bytes is above the bound of %d bytes, the longest supported hash", len(d.Digest), maxDigestLen)
	}
	if d.Iterations < 1 {
		return invalid(f+".iterations", "%d", d.Iterations)
	}
	if bound := MaxDigestBlocks / pbkdf2Blocks(d.Hash, len(d.Digest)); d.Iterations > bound {
		return tooCostly(f+".iterations", digestCostAdvice, "%d pbkdf2-%s iterations is above the bound of %d for a %d-byte digest", d.Iterations, d.Hash, bound, len(d.Digest))
	}
	return nil
}

// validate checks a key derivation that makes keyLen bytes: its shape,
// then its cost against the bounds above, each refusal naming the field.
func (k *KDF) validate(f string, keyLen int) error {
	if len(k.Salt) == 0 {
		return invalid(f+".salt", "missing")
	}
	switch k.Type {
	case "pbkdf2":
		if !hashSupported(k.Hash) || k.Iterations < 1 || k.Time != 0 || k.Memory != 0 || k.CPUs != 0 {
			return invalid(f, "pbkdf2 needs a supported hash and iterations and nothing else")
		}
		if bound := MaxPBKDF2Blocks / pbkdf2Blocks(k.Hash, keyLen); k.Iterations > bound {
			return tooCostly(f+".iterations", keyslotCostAdvice, "%d pbkdf2-%s iterations is above the bound of %d for a %d-byte key", k.Iterations, k.Hash, bound, keyLen)
		}
	case "argon2i", "argon2id":
		if k.Hash != "" || k.Iterations != 0 {
			return invalid(f, "argon2 takes time, memory and cpus, not hash or iterations")
		}
		if k.Memory < 8 || k.Memory > MaxArgonMemoryKiB {
			return tooCostly(f+".memory", keyslotCostAdvice, "%d KiB is outside the bounds 8 to %d KiB (1 GiB)", k.Memory, MaxArgonMemoryKiB)
		}
		if k.CPUs < 1 || k.CPUs > MaxArgonThreads {
			return invalid(f+".cpus", "%d is outside the bounds 1 to %d", k.CPUs, MaxArgonThreads)
		}
		if bound := min(MaxArgonTime, MaxArgonWorkKiB/k.Memory); k.Time < 1 || k.Time > bound {
			return tooCostly(f+".time", keyslotCostAdvice, "%d passes over %d KiB is outside the bounds 1 to %d (at most %d passes, and time × memory at most %d KiB, 32 passes over 1 GiB)", k.Time, k.Memory, bound, MaxArgonTime, MaxArgonWorkKiB)
		}
	default:
		return invalid(f+".type", "%q is not supported", k.Type)
	}
	return nil
}

// memoryKiB is the memory a derivation declares it needs (argon2's cost;
// pbkdf2 needs next to none).
func (k *KDF) memoryKiB() int {
	if k.Type == "argon2i" || k.Type == "argon2id" {
		return k.Memory
	}
	return 0
}

// sortedSlots returns keyslot numbers in unlock order: high priority first,
// then normal, each ascending; priority 0 ("ignore") slots are left out.
func (m *Metadata) sortedSlots() []int {
	var high, normal []int
	for id, k := range m.Keyslots {
		n, _ := slotID(id)
		switch {
		case k.Priority == nil || *k.Priority == 1:
			normal = append(normal, n)
		case *k.Priority == 2:
			high = append(high, n)
		}
	}
	sort.Ints(high)
	sort.Ints(normal)
	return append(high, normal...)
}

func (m *Metadata) segment() *Segment { return m.Segments["0"] }

func (m *Metadata) digest() *Digest {
	for _, d := range m.Digests {
		return d
	}
	return nil
}

var errNoSlot = errors.New("no free keyslot")
