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
	if err := g.check(); err != nil {
		return nil, err
	}
	return &g, nil
}

// NewGrant builds a grant from its parts in the form the agent's API
// carries them (keys as text, as ParseKey reads them) and checks it as
// ParseGrant does.
func NewGrant(disk, node string, supersedes []string) (*Grant, error) {
	g := &Grant{Disk: disk, Node: node}
	for _, s := range supersedes {
		k, err := ParseKey(s)
		if err != nil {
			return nil, fmt.Errorf("takeover grant for disk %q: %w", disk, err)
		}
		g.Supersedes = append(g.Supersedes, k)
	}
	if err := g.check(); err != nil {
		return nil, err
	}
	return g, nil
}

// check refuses a grant without a disk, a node UUID or a superseded key,
// and puts the node UUID in its canonical form.
func (g *Grant) check() error {
	if g.Disk == "" {
		return fmt.Errorf("takeover grant names no disk")
	}
	node, err := CanonicalUUID(g.Node)
	if err != nil {
		return fmt.Errorf("takeover grant for disk %q: %w", g.Disk, err)
	}
	g.Node = node
	if len(g.Supersedes) == 0 {
		return fmt.Errorf("takeover grant for disk %q names no superseded key", g.Disk)
	}
	return nil
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
