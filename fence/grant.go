package fence

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// ParseGrant decodes a grant in the form the controller puts into the
// publish context and the operator passes to 'vco-agent fence acquire
// --grant': JSON, {"disk":"...","node":"<uuid>","supersedes":["0x..."]}.
// Unknown fields are rejected so that a grant meant for a newer agent is
// not half-understood.
func ParseGrant(s string) (*Grant, error) {
	dec := json.NewDecoder(bytes.NewReader([]byte(s)))
	dec.DisallowUnknownFields()
	var g Grant
	if err := dec.Decode(&g); err != nil {
		return nil, fmt.Errorf("takeover grant is not valid JSON of the form {\"disk\":...,\"node\":...,\"supersedes\":[\"0x...\"]}: %w", err)
	}
	if dec.More() {
		return nil, fmt.Errorf("takeover grant has trailing data after the JSON object")
	}
	if g.Disk == "" {
		return nil, fmt.Errorf("takeover grant names no disk")
	}
	node, err := CanonicalUUID(g.Node)
	if err != nil {
		return nil, fmt.Errorf("takeover grant for disk %q: %w", g.Disk, err)
	}
	g.Node = node
	if len(g.Supersedes) == 0 {
		return nil, fmt.Errorf("takeover grant for disk %q names no superseded key", g.Disk)
	}
	return &g, nil
}

// Encode returns the grant in the form ParseGrant reads.
func (g *Grant) Encode() string {
	b, err := json.Marshal(g)
	if err != nil {
		// Only strings and keys: cannot fail.
		panic(err)
	}
	return string(b)
}
