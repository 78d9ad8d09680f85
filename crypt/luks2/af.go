package luks2

import (
	"crypto/rand"
	"crypto/sha1"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/binary"
	"fmt"
	"hash"
)

// The anti-forensic splitter (LUKS1 "AF", reused by LUKS2 keyslots of af
// type luks1) spreads a key over many stripes so that destroying any part of
// the stripes destroys the key. Each stripe is XORed into an accumulator,
// which is then "diffused": every hash-sized chunk i of it is replaced by
// H(be32(i) || chunk), the last chunk truncated.

func hashFunc(name string) (func() hash.Hash, error) {
	switch name {
	case "sha1":
		return sha1.New, nil
	case "sha256":
		return sha256.New, nil
	case "sha512":
		return sha512.New, nil
	}
	return nil, fmt.Errorf("hash %q is not supported", name)
}

func diffuse(buf []byte, newHash func() hash.Hash) {
	h := newHash()
	ds := h.Size()
	var iv [4]byte
	sum := make([]byte, 0, ds)
	for i, off := 0, 0; off < len(buf); i, off = i+1, off+ds {
		end := min(off+ds, len(buf))
		binary.BigEndian.PutUint32(iv[:], uint32(i))
		h.Reset()
		h.Write(iv[:])
		h.Write(buf[off:end])
		sum = h.Sum(sum[:0])
		copy(buf[off:end], sum)
	}
}

func xorInto(dst, src []byte) {
	for i := range dst {
		dst[i] ^= src[i]
	}
}

// afSplit returns stripes*len(key) bytes from which afMerge recovers key.
func afSplit(key []byte, stripes int, hashName string) ([]byte, error) {
	newHash, err := hashFunc(hashName)
	if err != nil {
		return nil, err
	}
	n := len(key)
	out := make([]byte, n*stripes)
	if _, err := rand.Read(out[:n*(stripes-1)]); err != nil {
		return nil, fmt.Errorf("random stripes: %w", err)
	}
	acc := make([]byte, n)
	for i := 0; i < stripes-1; i++ {
		xorInto(acc, out[i*n:(i+1)*n])
		diffuse(acc, newHash)
	}
	last := out[(stripes-1)*n:]
	copy(last, acc)
	xorInto(last, key)
	clear(acc)
	return out, nil
}

// afMerge inverts afSplit.
func afMerge(material []byte, keySize, stripes int, hashName string) ([]byte, error) {
	newHash, err := hashFunc(hashName)
	if err != nil {
		return nil, err
	}
	if len(material) < keySize*stripes {
		return nil, fmt.Errorf("key material of %d bytes is shorter than %d stripes of %d", len(material), stripes, keySize)
	}
	acc := make([]byte, keySize)
	for i := 0; i < stripes-1; i++ {
		xorInto(acc, material[i*keySize:(i+1)*keySize])
		diffuse(acc, newHash)
	}
	xorInto(acc, material[(stripes-1)*keySize:stripes*keySize])
	return acc, nil
}
