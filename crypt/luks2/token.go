package luks2

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strconv"
	"strings"

	luksgo "github.com/anatol/luks.go"
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

// Check refuses a token the node plugin cannot have made: one naming no
// key, or whose ciphertext is not the transit engine's for the key version
// it names (the engine's ciphertexts are "vault:vN:..." for version N).
// The agent checks a token it is asked to write into a new header; a
// token read from a header is held to parseTransitToken's rules only.
func (t TransitToken) Check() error {
	prefix := fmt.Sprintf("vault:v%d:", t.KeyVersion)
	switch {
	case t.KeyName == "":
		return errors.New("the transit token names no key")
	case t.KeyVersion < 1:
		return fmt.Errorf("the transit token's key version %d is not a version (1 or more)", t.KeyVersion)
	case !strings.HasPrefix(t.Ciphertext, prefix) || len(t.Ciphertext) <= len(prefix):
		return fmt.Errorf("the transit token's ciphertext is not a transit ciphertext of key version %d (vault:v%d:...)", t.KeyVersion, t.KeyVersion)
	}
	return nil
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
// id -1 and nil when it has none. When the header in use is the primary
// copy the token is read with luks.go's Tokens() (the unlock path goes
// through luks.go, see the package doc) and must agree with this
// package's reading of the header it validated; from the secondary copy,
// which luks.go does not read, this package's reading is the answer.
func (v *Volume) TransitToken() (int, *TransitToken, error) {
	id, tok, err := v.transitToken()
	if err != nil || v.Header.Source != "primary" {
		return id, tok, err
	}
	lid, ltok, err := luksGoTransitToken(v.path)
	if err != nil {
		return -1, nil, fmt.Errorf("%s: reading the tokens with luks.go: %w", v.path, err)
	}
	if lid != id || !reflect.DeepEqual(ltok, tok) {
		return -1, nil, fmt.Errorf("%s: luks.go reads the %s token differently from the header this agent validated (the header changed while it was read?); retry, and compare with 'vco-agent luks dump'", v.path, TransitTokenType)
	}
	return lid, ltok, nil
}

// luksGoTransitToken reads the vco-transit token of the LUKS2 volume at
// path with luks.go, parsed by the same rules as this package's reading.
func luksGoTransitToken(path string) (id int, tok *TransitToken, err error) {
	defer func() {
		// luks.go trusts what it reads more than this package does; a
		// header rewritten after it was validated must not take the
		// process down.
		if r := recover(); r != nil {
			id, tok, err = -1, nil, fmt.Errorf("luks.go failed on the header: %v", r)
		}
	}()
	d, err := luksgo.Open(path)
	if err != nil {
		return -1, nil, err
	}
	defer d.Close()
	toks, err := d.Tokens()
	if err != nil {
		return -1, nil, err
	}
	sort.Slice(toks, func(i, j int) bool { return toks[i].ID < toks[j].ID })
	for _, t := range toks {
		if t.Type != TransitTokenType {
			continue
		}
		tok, err := parseTransitToken(t.Payload)
		if err != nil {
			return -1, nil, fmt.Errorf("token %d: %w", t.ID, err)
		}
		return t.ID, tok, nil
	}
	return -1, nil, nil
}

// transitToken is TransitToken read from the validated header alone.
func (v *Volume) transitToken() (int, *TransitToken, error) {
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
		tok, err := parseTransitToken(raw)
		if err != nil {
			return -1, nil, fmt.Errorf("%s: token %d: %w", v.path, id, err)
		}
		return id, tok, nil
	}
	return -1, nil, nil
}

// parseTransitToken reads a vco-transit token's JSON.
func parseTransitToken(raw []byte) (*TransitToken, error) {
	var t transitTokenJSON
	if err := json.Unmarshal(raw, &t); err != nil {
		return nil, err
	}
	if t.KeyName == "" || t.Ciphertext == "" || t.KeyVersion < 1 {
		return nil, fmt.Errorf("a token of type %s lacks key_name, key_version or ciphertext", TransitTokenType)
	}
	tok := &TransitToken{Mount: t.Mount, KeyName: t.KeyName, KeyVersion: t.KeyVersion, Ciphertext: t.Ciphertext}
	for _, s := range t.Keyslots {
		n, _ := strconv.Atoi(s)
		tok.Keyslots = append(tok.Keyslots, n)
	}
	return tok, nil
}

// SetTransitToken stores t, replacing the volume's existing vco-transit
// token if there is one, and returns the token id.
func (v *Volume) SetTransitToken(t TransitToken) (int, error) {
	raw, err := t.marshal()
	if err != nil {
		return -1, fmt.Errorf("%s: %w", v.path, err)
	}
	id, _, err := v.transitToken()
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
