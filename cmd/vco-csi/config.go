package main

// The add-on hands the plugin its settings as Kubernetes objects: the
// controller's cloud credential from the Secret csi-driver-secret (as
// environment variables and a file), the node's key backend from the
// ConfigMaps csi-key-backend-config and openbao-ca plus a projected
// ServiceAccount token, all in one directory. These checks run at start so
// a wrong object stops the pod with an error naming the object and its key,
// instead of failing the first volume operation much later.

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
)

const (
	credentialSecret = "Secret csi-driver-secret"
	keyBackendConfig = "ConfigMap csi-key-backend-config"
	keyBackendCA     = "ConfigMap openbao-ca"
	apiPath          = "/api/1"
)

// unexpanded matches a Kubernetes $(NAME) reference that kubelet left
// alone because the variable was not defined.
var unexpanded = regexp.MustCompile(`\$\([A-Za-z_][A-Za-z0-9_]*\)`)

// credential is the controller's part of csi-driver-secret.
type credential struct {
	PortalURL  string // key url
	Customer   string // key customer
	Cloudspace string // key cloudspace
	TokenFile  string // key jwt, mounted as a file
}

// apiURL checks the credential and returns the API root it names.
func (c credential) apiURL() (string, error) {
	root, err := portalAPIURL(c.PortalURL)
	if err != nil {
		return "", err
	}
	for _, f := range []struct{ key, flag, v string }{
		{"customer", "--customer", c.Customer},
		{"cloudspace", "--cloudspace", c.Cloudspace},
	} {
		if err := plainValue(credentialSecret, f.key, f.flag, f.v); err != nil {
			return "", err
		}
	}
	if err := nonEmptyFile(credentialSecret, "jwt", c.TokenFile); err != nil {
		return "", err
	}
	return root, nil
}

// portalAPIURL turns the portal's base URL (scheme://host[:port], a
// trailing slash tolerated) into the API root.
func portalAPIURL(raw string) (string, error) {
	bad := func(why string) error {
		return fmt.Errorf("%s key url (--portal-url) %q %s; want the portal's scheme and host, e.g. https://try.whitesky.cloud", credentialSecret, raw, why)
	}
	if raw == "" {
		return "", fmt.Errorf("%s key url (--portal-url) is empty; set it to the portal's scheme and host, e.g. https://try.whitesky.cloud", credentialSecret)
	}
	if unexpanded.MatchString(raw) {
		return "", bad("was not filled in (the pod has no such environment variable)")
	}
	if strings.TrimSpace(raw) != raw {
		return "", bad("has leading or trailing white space")
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return "", bad("is not a URL")
	case u.Scheme != "https" && u.Scheme != "http":
		return "", bad("has no http or https scheme")
	case u.Host == "" || u.Hostname() == "":
		return "", bad("has no host")
	case u.User != nil:
		return "", bad("carries user information")
	case u.Path != "" && u.Path != "/":
		return "", bad("has a path (" + u.Path + "); the plugin appends " + apiPath + " itself")
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return "", bad("has a query or fragment")
	}
	return u.Scheme + "://" + u.Host + apiPath, nil
}

// plainValue refuses an empty, unfilled or white-space-padded value.
func plainValue(object, key, flagName, v string) error {
	switch {
	case v == "":
		return fmt.Errorf("%s key %s (%s) is empty", object, key, flagName)
	case unexpanded.MatchString(v):
		return fmt.Errorf("%s key %s (%s) %q was not filled in (the pod has no such environment variable)", object, key, flagName, v)
	case strings.TrimSpace(v) != v || strings.ContainsAny(v, " \t\r\n"):
		return fmt.Errorf("%s key %s (%s) %q contains white space", object, key, flagName, v)
	}
	return nil
}

// nonEmptyFile checks a mounted key holds something, without reading it
// into any message: it is a secret.
func nonEmptyFile(object, key, path string) error {
	b, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s key %s: %s does not exist; is the key in the object and the object mounted there?", object, key, path)
	case err != nil:
		return fmt.Errorf("%s key %s: %v", object, key, err)
	case strings.TrimSpace(string(b)) == "":
		return fmt.Errorf("%s key %s: %s is empty", object, key, path)
	}
	return nil
}

// keyBackend is what the node plugin needs to wrap passphrases.
type keyBackend struct {
	Transit transit.Config
	Key     crypt.TransitKey
}

// mountPath matches a Vault mount path: segments of letters, digits,
// '-', '_' and '.', separated by single slashes.
var mountPath = regexp.MustCompile(`^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$`)

// loadKeyBackend reads the key backend directory of the node pod: the keys
// of csi-key-backend-config, ca.crt of openbao-ca and the ServiceAccount
// token. Without the key address there is no key backend (nil, nil): the
// ConfigMap is optional and encrypted volumes are then refused at stage.
func loadKeyBackend(dir string) (*keyBackend, error) {
	if st, err := os.Stat(dir); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("key backend directory: %v", err)
	} else if !st.IsDir() {
		return nil, fmt.Errorf("key backend directory %s is not a directory", dir)
	}
	read := func(key string) (string, bool, error) {
		b, err := os.ReadFile(filepath.Join(dir, key))
		if errors.Is(err, fs.ErrNotExist) {
			return "", false, nil
		}
		if err != nil {
			return "", false, fmt.Errorf("%s key %s: %v", keyBackendConfig, key, err)
		}
		return strings.TrimSpace(string(b)), true, nil
	}
	addr, ok, err := read("address")
	if err != nil {
		return nil, err
	}
	if !ok {
		for _, k := range []string{"transit_key", "role", "transit_mount", "auth_mount", "namespace"} {
			if _, present, _ := read(k); present {
				return nil, fmt.Errorf("%s has key %s but no key address (in %s); set address to the Vault/OpenBao URL, e.g. https://openbao.example.net:8200", keyBackendConfig, k, dir)
			}
		}
		return nil, nil
	}
	u, err := url.Parse(addr)
	switch {
	case addr == "":
		return nil, fmt.Errorf("%s key address is empty; set it to the Vault/OpenBao URL, e.g. https://openbao.example.net:8200", keyBackendConfig)
	case err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Hostname() == "":
		return nil, fmt.Errorf("%s key address %q is not an http(s) URL with a host, e.g. https://openbao.example.net:8200", keyBackendConfig, addr)
	case u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.Fragment != "" || u.User != nil:
		return nil, fmt.Errorf("%s key address %q has a path, query, fragment or user; want scheme://host:port only", keyBackendConfig, addr)
	}
	kb := &keyBackend{Transit: transit.Config{Address: strings.TrimRight(addr, "/"), Mount: "transit", KubernetesMount: "kubernetes",
		ServiceAccountTokenFile: filepath.Join(dir, "token")}}
	for _, f := range []struct {
		key      string
		required bool
		mount    bool
		to       *string
	}{
		{"transit_key", true, false, &kb.Key.Name},
		{"role", true, false, &kb.Transit.KubernetesRole},
		{"transit_mount", false, true, &kb.Transit.Mount},
		{"auth_mount", false, true, &kb.Transit.KubernetesMount},
		{"namespace", false, true, &kb.Transit.Namespace},
	} {
		v, present, err := read(f.key)
		if err != nil {
			return nil, err
		}
		switch {
		case !present && f.required:
			return nil, fmt.Errorf("%s has no key %s (in %s); it is required with address", keyBackendConfig, f.key, dir)
		case !present:
			continue
		case v == "":
			return nil, fmt.Errorf("%s key %s is empty; give it a value or remove the key", keyBackendConfig, f.key)
		case f.mount && !mountPath.MatchString(strings.Trim(v, "/")):
			return nil, fmt.Errorf("%s key %s %q is not a path of letters, digits, '-', '_' and '.' segments", keyBackendConfig, f.key, v)
		case !f.mount && strings.ContainsAny(v, " \t\r\n/"):
			return nil, fmt.Errorf("%s key %s %q contains white space or '/'", keyBackendConfig, f.key, v)
		}
		if f.mount {
			v = strings.Trim(v, "/")
		}
		*f.to = v
	}
	kb.Key.Mount = kb.Transit.Mount

	ca := filepath.Join(dir, "ca.crt")
	if b, err := os.ReadFile(ca); err == nil {
		if err := checkPEMCertificates(b); err != nil {
			return nil, fmt.Errorf("%s key ca.crt (%s): %v", keyBackendCA, ca, err)
		}
		kb.Transit.CACertFile = ca
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s key ca.crt: %v", keyBackendCA, err)
	}

	if err := nonEmptyFile("projected ServiceAccount token (audience vault)", "token", kb.Transit.ServiceAccountTokenFile); err != nil {
		return nil, err
	}
	return kb, nil
}

// nodeKeyBackend reads the key backend directory and makes its transit
// client: nil, nil, nil when no key backend is configured.
func nodeKeyBackend(dir string) (*transit.Client, *keyBackend, error) {
	kb, err := loadKeyBackend(dir)
	if err != nil || kb == nil {
		return nil, nil, err
	}
	w, err := transit.New(kb.Transit)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %v", keyBackendConfig, err)
	}
	return w, kb, nil
}

// checkPEMCertificates requires at least one PEM block and every block to
// be a parseable certificate, so a truncated paste fails at start.
func checkPEMCertificates(b []byte) error {
	n := 0
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			return fmt.Errorf("holds a PEM block of type %q; want only CERTIFICATE blocks", blk.Type)
		}
		if _, err := x509.ParseCertificate(blk.Bytes); err != nil {
			return fmt.Errorf("certificate %d does not parse: %v", n+1, err)
		}
		n++
	}
	if n == 0 {
		return errors.New("holds no PEM certificate")
	}
	if strings.TrimSpace(string(b)) != "" {
		return errors.New("has text after its last certificate that is not PEM (truncated or damaged?)")
	}
	return nil
}
