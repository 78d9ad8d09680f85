package vault

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Transit is a server set up as the key backend of one transit key for a
// lab without Kubernetes: initialised and unsealed, the transit engine at
// Mount with Key, a policy allowing exactly encrypt, decrypt and rewrap
// with it, and Token, a token of that policy (the node plugin's
// --vault-token-file).
type Transit struct {
	*Server
	Mount, Key, Token string
}

// StartTransit starts a server (Start) and sets it up as Transit says.
func StartTransit(ctx context.Context, bin, dir string, o Options, mount, key string) (*Transit, error) {
	s, err := Start(ctx, bin, dir, o)
	if err != nil {
		return nil, err
	}
	t := &Transit{Server: s, Mount: mount, Key: key}
	if err := t.setUp(ctx); err != nil {
		s.Stop()
		return nil, err
	}
	return t, nil
}

// setUp initialises, unseals and configures the server.
func (t *Transit) setUp(ctx context.Context) error {
	unseal, root, err := t.Init(ctx)
	if err != nil {
		return err
	}
	if err := t.Unseal(ctx, unseal); err != nil {
		return err
	}
	policy := filepath.Join(t.Dir, "transit-policy.hcl")
	var b strings.Builder
	for _, op := range []string{"encrypt", "decrypt", "rewrap"} {
		fmt.Fprintf(&b, "path %q { capabilities = [\"update\"] }\n", t.Mount+"/"+op+"/"+t.Key)
	}
	if err := os.WriteFile(policy, []byte(b.String()), 0o600); err != nil {
		return err
	}
	for _, args := range [][]string{
		{"secrets", "enable", "-path=" + t.Mount, "transit"},
		{"write", "-f", t.Mount + "/keys/" + t.Key},
		{"policy", "write", "lab-transit", policy},
	} {
		if _, err := t.CLI(ctx, root, args...); err != nil {
			return err
		}
	}
	out, err := t.CLI(ctx, root, "token", "create", "-policy=lab-transit", "-no-default-policy", "-period=24h", "-format=json")
	if err != nil {
		return err
	}
	var r struct {
		Auth struct {
			ClientToken string `json:"client_token"`
		} `json:"auth"`
	}
	if err := json.Unmarshal(out, &r); err != nil || r.Auth.ClientToken == "" {
		return fmt.Errorf("vault token create: no client token in its answer (%v)", err)
	}
	t.Token = r.Auth.ClientToken
	return nil
}

// Describe names the server for a report.
func (t *Transit) Describe() string {
	return fmt.Sprintf("Vault %s built from source at %s (file storage, TLS), transit key %s/%s", Version, t.Addr, t.Mount, t.Key)
}
