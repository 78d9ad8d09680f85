package luks2

import (
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
)

// TransitTokenType is the LUKS2 token type that carries a volume passphrase
// wrapped by a Vault/OpenBao transit key. The passphrase itself is never in
// the header, only its transit ciphertext.
const TransitTokenType = "vco-transit"

// TransitToken is the content of a vco-transit token.
type TransitToken struct {
	// Keyslots are the keyslots the wrapped passphrase opens.
	Keyslots []int
	// Mount is the transit engine's mount path (default "transit").
	Mount string
	// KeyName is the transit key that wrapped the passphrase.
	KeyName string
	// KeyVersion is the version of that key the ciphertext was made with.
	KeyVersion int
	// Ciphertext is the transit ciphertext, "vault:vN:...".
	Ciphertext string
}

type transitTokenJSON struct {
	Type       string   `json:"type"`
	Keyslots   []string `json:"keyslots"`
	Mount      string   `json:"mount,omitempty"`
	KeyName    string   `json:"key_name"`
	KeyVersion int      `json:"key_version"`
	Ciphertext string   `json:"ciphertext"`
}

// Tokens returns the raw JSON of every token by id.
func (v *Volume) Tokens() map[int]json.RawMessage {
	out := map[int]json.RawMessage{}
	for id, raw := range v.Header.Meta.Tokens {
		n, _ := strconv.Atoi(id)
		out[n] = raw
	}
	return out
}

// TransitToken returns the volume's vco-transit token and its id, or
// id -1 and nil when it has none.
func (v *Volume) TransitToken() (int, *TransitToken, error) {
	ids := make([]int, 0)
	for id := range v.Tokens() {
		ids = append(ids, id)
	}
	sort.Ints(ids)
	for _, id := range ids {
		raw := v.Header.Meta.Tokens[strconv.Itoa(id)]
		var t transitTokenJSON
		if err := json.Unmarshal(raw, &t); err != nil {
			return -1, nil, fmt.Errorf("%s: token %d: %w", v.path, id, err)
		}
		if t.Type != TransitTokenType {
			continue
		}
		if t.KeyName == "" || t.Ciphertext == "" || t.KeyVersion < 1 {
			return -1, nil, fmt.Errorf("%s: token %d of type %s lacks key_name, key_version or ciphertext", v.path, id, TransitTokenType)
		}
		tok := &TransitToken{Mount: t.Mount, KeyName: t.KeyName, KeyVersion: t.KeyVersion, Ciphertext: t.Ciphertext}
		for _, s := range t.Keyslots {
			n, _ := strconv.Atoi(s)
			tok.Keyslots = append(tok.Keyslots, n)
		}
		return id, tok, nil
	}
	return -1, nil, nil
}

// SetTransitToken stores t, replacing the volume's existing vco-transit
// token if there is one, and returns the token id.
func (v *Volume) SetTransitToken(t TransitToken) (int, error) {
	raw, err := t.marshal()
	if err != nil {
		return -1, fmt.Errorf("%s: %w", v.path, err)
	}
	id, _, err := v.TransitToken()
	if err != nil {
		return -1, err
	}
	if id < 0 {
		for i := 0; i < maxTokens; i++ {
			if _, used := v.Header.Meta.Tokens[strconv.Itoa(i)]; !used {
				id = i
				break
			}
		}
		if id < 0 {
			return -1, fmt.Errorf("%s: all %d token slots are in use", v.path, maxTokens)
		}
	}
	nm := cloneMeta(v.Header.Meta)
	nm.Tokens[strconv.Itoa(id)] = raw
	if err := v.writeHeaders(nm); err != nil {
		return -1, err
	}
	return id, nil
}

func (t TransitToken) marshal() (json.RawMessage, error) {
	if t.KeyName == "" || t.Ciphertext == "" || t.KeyVersion < 1 || len(t.Keyslots) == 0 {
		return nil, fmt.Errorf("a transit token needs keyslots, key name, key version and ciphertext")
	}
	j := transitTokenJSON{Type: TransitTokenType, Mount: t.Mount, KeyName: t.KeyName, KeyVersion: t.KeyVersion, Ciphertext: t.Ciphertext}
	slots := append([]int(nil), t.Keyslots...)
	sort.Ints(slots)
	for _, s := range slots {
		j.Keyslots = append(j.Keyslots, strconv.Itoa(s))
	}
	return json.Marshal(j)
}

// RemoveToken deletes token id.
func (v *Volume) RemoveToken(id int) error {
	if _, ok := v.Header.Meta.Tokens[strconv.Itoa(id)]; !ok {
		return fmt.Errorf("%s: token %d does not exist", v.path, id)
	}
	nm := cloneMeta(v.Header.Meta)
	delete(nm.Tokens, strconv.Itoa(id))
	return v.writeHeaders(nm)
}
