package luks2

import (
	"context"
	"crypto/aes"
	"crypto/rand"
	"crypto/subtle"
	"errors"
	"fmt"

	"golang.org/x/crypto/argon2"
	"golang.org/x/crypto/pbkdf2"
	"golang.org/x/crypto/xts"
)

// KDFParams is the cost of the key derivation of a new keyslot.
type KDFParams struct {
	// Type is "argon2id" (default), "argon2i" or "pbkdf2".
	Type string
	// Time is the argon2 iteration count.
	Time int
	// MemoryKiB is the argon2 memory cost in KiB.
	MemoryKiB int
	// Threads is the argon2 parallelism.
	Threads int
	// Iterations is the pbkdf2 iteration count (default 1,000,000).
	Iterations int
	// Hash is the pbkdf2 hash (default sha256).
	Hash string
}

// DefaultKDF is the cost used when none is given: argon2id with 4 passes
// over 64 MiB on 2 lanes (about 0.4 s on one core of a small VM). The Go
// argon2 implementation allocates the whole memory cost at once, so an
// unlock peaks at about 72 MiB of resident memory (checked by
// TestDefaultKDFFitsNodePluginMemoryLimit); two concurrent unlocks still
// fit under the 256 MiB memory limit of the node plugin. cryptsetup's own
// default asks for up to 1 GiB, which such a container could not unlock.
var DefaultKDF = KDFParams{Type: "argon2id", Time: 4, MemoryKiB: 64 << 10, Threads: 2}

// DefaultDigestIterations is the pbkdf2 iteration count of the volume-key
// digest. The digest only confirms a key recovered from a keyslot, the
// passphrase cost lives in the keyslot KDF; cryptsetup uses at least 1000.
const DefaultDigestIterations = 100000

func (p KDFParams) withDefaults() KDFParams {
	if p.Type == "" {
		p.Type = DefaultKDF.Type
	}
	switch p.Type {
	case "argon2id", "argon2i":
		if p.Time == 0 {
			p.Time = DefaultKDF.Time
		}
		if p.MemoryKiB == 0 {
			p.MemoryKiB = DefaultKDF.MemoryKiB
		}
		if p.Threads == 0 {
			p.Threads = DefaultKDF.Threads
		}
	case "pbkdf2":
		if p.Hash == "" {
			p.Hash = "sha256"
		}
		if p.Iterations == 0 {
			p.Iterations = 1000000
		}
	}
	return p
}

func (p KDFParams) kdf(keyLen int) (KDF, error) {
	p = p.withDefaults()
	salt := make([]byte, 32)
	if _, err := rand.Read(salt); err != nil {
		return KDF{}, err
	}
	var k KDF
	switch p.Type {
	case "argon2id", "argon2i":
		k = KDF{Type: p.Type, Time: p.Time, Memory: p.MemoryKiB, CPUs: p.Threads, Salt: salt}
	case "pbkdf2":
		k = KDF{Type: p.Type, Hash: p.Hash, Iterations: p.Iterations, Salt: salt}
	default:
		return KDF{}, fmt.Errorf("KDF type %q is not supported", p.Type)
	}
	if err := k.validate("kdf", keyLen); err != nil {
		return KDF{}, err
	}
	return k, nil
}

func (k *KDF) derive(passphrase []byte, keyLen int) ([]byte, error) {
	switch k.Type {
	case "argon2id":
		return argon2.IDKey(passphrase, k.Salt, uint32(k.Time), uint32(k.Memory), uint8(k.CPUs), uint32(keyLen)), nil
	case "argon2i":
		return argon2.Key(passphrase, k.Salt, uint32(k.Time), uint32(k.Memory), uint8(k.CPUs), uint32(keyLen)), nil
	case "pbkdf2":
		h, err := hashFunc(k.Hash)
		if err != nil {
			return nil, err
		}
		return pbkdf2.Key(passphrase, k.Salt, k.Iterations, keyLen, h), nil
	}
	return nil, fmt.Errorf("KDF type %q is not supported", k.Type)
}

// Keyslot areas are encrypted like a dm-crypt device of 512-byte sectors
// whose first sector is the start of the area (plain64 IV = sector number).
const areaSector = 512

func cryptArea(buf, key []byte, decrypt bool) error {
	c, err := xts.NewCipher(aes.NewCipher, key)
	if err != nil {
		return err
	}
	for i := 0; i*areaSector < len(buf); i++ {
		s := buf[i*areaSector : (i+1)*areaSector]
		if decrypt {
			c.Decrypt(s, s, uint64(i))
		} else {
			c.Encrypt(s, s, uint64(i))
		}
	}
	return nil
}

// materialLen is the number of bytes of a keyslot area that hold the split
// key, rounded up to whole area sectors.
func materialLen(keySize, stripes int) int {
	n := keySize * stripes
	return (n + areaSector - 1) / areaSector * areaSector
}

// ErrWrongPassphrase is returned when no keyslot accepts the passphrase.
var ErrWrongPassphrase = errors.New("no keyslot accepts this passphrase")

// openSlot recovers the volume key from keyslot id, or returns
// ErrWrongPassphrase when the digest does not confirm it.
func (v *Volume) openSlot(id string, passphrase []byte) ([]byte, error) {
	return v.openSlotContext(context.Background(), id, passphrase, nil)
}

// openSlotContext is openSlot with its key derivation run within budget
// and abandoned when ctx ends (deriveContext).
func (v *Volume) openSlotContext(ctx context.Context, id string, passphrase []byte, budget *KDFBudget) ([]byte, error) {
	m := v.Header.Meta
	k, ok := m.Keyslots[id]
	if !ok {
		return nil, fmt.Errorf("%s: keyslot %s does not exist", v.path, id)
	}
	areaKey, err := deriveContext(ctx, k.KDF, passphrase, k.Area.KeySize, budget)
	if err != nil {
		return nil, fmt.Errorf("%s: keyslot %s: %w", v.path, id, err)
	}
	defer clear(areaKey)
	buf := make([]byte, materialLen(k.KeySize, k.AF.Stripes))
	defer clear(buf)
	if _, err := v.f.ReadAt(buf, int64(k.Area.Offset)); err != nil {
		return nil, fmt.Errorf("%s: read keyslot %s area: %w", v.path, id, err)
	}
	if err := cryptArea(buf, areaKey, true); err != nil {
		return nil, err
	}
	key, err := afMerge(buf, k.KeySize, k.AF.Stripes, k.AF.Hash)
	if err != nil {
		return nil, err
	}
	ok, err = m.digest().verify(key)
	if err != nil {
		clear(key)
		return nil, err
	}
	if !ok {
		clear(key)
		return nil, ErrWrongPassphrase
	}
	return key, nil
}

func (d *Digest) compute(key []byte) ([]byte, error) {
	h, err := hashFunc(d.Hash)
	if err != nil {
		return nil, err
	}
	return pbkdf2.Key(key, d.Salt, d.Iterations, len(d.Digest), h), nil
}

func (d *Digest) verify(key []byte) (bool, error) {
	got, err := d.compute(key)
	if err != nil {
		return false, err
	}
	return subtle.ConstantTimeCompare(got, d.Digest) == 1, nil
}

// newDigest makes the pbkdf2 digest of a new volume key.
func newDigest(key []byte, iterations int) (*Digest, error) {
	if iterations == 0 {
		iterations = DefaultDigestIterations
	}
	d := &Digest{Type: "pbkdf2", Hash: "sha256", Iterations: iterations,
		Salt: make([]byte, 32), Digest: make([]byte, 32), Segments: []string{"0"}}
	if err := d.validateCost("digests.0"); err != nil {
		return nil, err
	}
	if _, err := rand.Read(d.Salt); err != nil {
		return nil, err
	}
	sum, err := d.compute(key)
	if err != nil {
		return nil, err
	}
	d.Digest = sum
	return d, nil
}

// sealSlot builds keyslot metadata at area offset off and the encrypted key
// material to write there.
func sealSlot(volumeKey, passphrase []byte, p KDFParams, off uint64) (*Keyslot, []byte, error) {
	ks := len(volumeKey)
	kdf, err := p.kdf(ks)
	if err != nil {
		return nil, nil, err
	}
	k := &Keyslot{
		Type:    "luks2",
		KeySize: ks,
		AF:      AF{Type: "luks1", Stripes: afStripes, Hash: "sha256"},
		Area:    Area{Type: "raw", Offset: U64(off), Size: U64(areaSize(ks)), Encryption: cipherXTS, KeySize: ks},
		KDF:     kdf,
	}
	split, err := afSplit(volumeKey, afStripes, k.AF.Hash)
	if err != nil {
		return nil, nil, err
	}
	buf := make([]byte, materialLen(ks, afStripes))
	copy(buf, split)
	clear(split)
	areaKey, err := kdf.derive(passphrase, k.Area.KeySize)
	if err != nil {
		return nil, nil, err
	}
	defer clear(areaKey)
	if err := cryptArea(buf, areaKey, false); err != nil {
		return nil, nil, err
	}
	return k, buf, nil
}

// areaSize is the size of a keyslot area for a key of keySize bytes, in
// whole 4 KiB blocks as cryptsetup allocates them.
func areaSize(keySize int) uint64 {
	return (uint64(keySize*afStripes) + 4095) / 4096 * 4096
}
