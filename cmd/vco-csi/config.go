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
	"github.com/whitesky-cloud/vco-storage/internal/cleartext"
)

const (
	credentialSecret = "Secret csi-driver-secret"
	keyBackendConfig = "ConfigMap csi-key-backend-config"
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
	// InsecureAllowHTTP (--insecure-allow-http) lets the url be plain http
	// to a host that is not a loopback address.
	InsecureAllowHTTP bool
}

// apiURL checks the credential and returns the API root it names.
func (c credential) apiURL() (string, error) {
	root, err := portalAPIURL(c.PortalURL, c.InsecureAllowHTTP)
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

// quotable is a URL as an error may quote it: its user information's
// password, if any, replaced (url.URL.Redacted); a value that does not
// parse is quoted only up to its first "@".
func quotable(raw string) string {
	if u, err := url.Parse(raw); err == nil {
		return u.Redacted()
	}
	if i := strings.Index(raw, "@"); i >= 0 {
		return raw[:i] + "@..."
	}
	return raw
}

// portalAPIURL turns the portal's base URL (scheme://host[:port], a
// trailing slash tolerated) into the API root. Plain http is refused but
// to a loopback address or when insecure (--insecure-allow-http) is set.
func portalAPIURL(raw string, insecure bool) (string, error) {
	bad := func(why string) error {
		return fmt.Errorf("%s key url (--portal-url) %q %s; want the portal's scheme and host, e.g. https://try.whitesky.cloud", credentialSecret, quotable(raw), why)
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
	case !cleartext.Allowed(u, insecure):
		return "", bad("is plain http to " + u.Hostname() + ", not a loopback address: the cloud JWT would travel in clear (" +
			cleartext.Option + " allows it for test set-ups)")
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
	// CARef is the caRef the ConfigMap gave, and CASource the object and
	// key the CA bundle was read from ("" for the system roots).
	CARef, CASource string
}

// DefaultTransitKey is the transit key that wraps passphrases when the
// ConfigMap names none (the seed's VCOCluster settings have no such
// field). docs/encryption.md gives every cluster a transit mount of its
// own, so each cluster's key is a different one.
const DefaultTransitKey = "vco-csi-volumes"

// DefaultCARef is the object the CA bundle is delivered in, and the only
// one the node DaemonSet projects (as a ConfigMap and as a Secret).
const DefaultCARef = "openbao-ca"

// caKeys are the keys a CA bundle is found under in a ConfigMap or
// Secret, in the order they are tried: Kubernetes' own, and the usual
// names of bundles made by hand and by cert-manager's trust tooling.
var caKeys = []string{"ca.crt", "ca.pem", "ca-bundle.crt"}

// caSources are the directories of the key backend directory the node
// DaemonSet projects DefaultCARef's keys into.
var caSources = []struct{ kind, dir string }{{"ConfigMap", "ca/configmap"}, {"Secret", "ca/secret"}}

// keySetting is one setting of csi-key-backend-config: its names, the
// seed's (CAPVCO's VCOCluster) first and ours after it as aliases.
type keySetting struct {
	names    []string
	required bool
	mount    bool // a path of segments; slashes around it are dropped
	def      string
}

// normal is a value as it is used: a mount path without the slashes
// around it, and the Kubernetes auth path without the "auth/" the seed's
// k8sAuthPath may carry (the login is POST /v1/auth/<path>/login).
func (ks keySetting) normal(v string) string {
	if !ks.mount {
		return v
	}
	v = strings.Trim(v, "/")
	if ks.names[0] == "k8sAuthPath" {
		v = strings.TrimPrefix(v, "auth/")
	}
	return v
}

var (
	settingAddress   = keySetting{names: []string{"address"}, required: true}
	settingTransit   = keySetting{names: []string{"transitMount", "transit_mount"}, mount: true, def: "transit"}
	settingKey       = keySetting{names: []string{"transitKey", "transit_key"}, def: DefaultTransitKey}
	settingAuth      = keySetting{names: []string{"k8sAuthPath", "auth_mount"}, mount: true, def: "kubernetes"}
	settingRole      = keySetting{names: []string{"role"}, required: true}
	settingNamespace = keySetting{names: []string{"namespace"}, mount: true}
	settingCARef     = keySetting{names: []string{"caRef"}, def: DefaultCARef}
	keySettings      = []keySetting{settingAddress, settingTransit, settingKey, settingAuth, settingRole, settingNamespace, settingCARef}
)

// mountPath matches a Vault mount path: segments of letters, digits,
// '-', '_' and '.', separated by single slashes.
var mountPath = regexp.MustCompile(`^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$`)

// objectName matches a Kubernetes object name (a DNS subdomain).
var objectName = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$`)

// loadKeyBackend reads the key backend directory of the node pod: the keys
// of csi-key-backend-config, the CA bundle of openbao-ca (ConfigMap or
// Secret) and the ServiceAccount token. Without any key of
// csi-key-backend-config there is no key backend (nil, nil): the
// ConfigMap is optional and encrypted volumes are then refused at stage.
// Any error names the ConfigMap's key as written, never a value of the
// token. insecure (--insecure-allow-http) lets the address be plain http
// to a host that is not a loopback address.
func loadKeyBackend(dir string, insecure bool) (*keyBackend, error) {
	given, err := keyBackendKeys(dir)
	if err != nil || len(given) == 0 {
		return nil, err
	}
	values := map[string]string{}
	named := map[string]string{} // the name a setting was given under
	for _, ks := range keySettings {
		v, from, err := ks.read(dir)
		if err != nil {
			return nil, err
		}
		named[ks.names[0]] = from
		if values[ks.names[0]], err = ks.check(v, from, given); err != nil {
			return nil, err
		}
	}
	addr := values["address"]
	if err := checkKeyBackendAddress(addr, insecure); err != nil {
		return nil, err
	}
	kb := &keyBackend{
		Transit: transit.Config{Address: strings.TrimRight(addr, "/"), InsecureAllowHTTP: insecure, Mount: values["transitMount"], Namespace: values["namespace"],
			KubernetesRole: values["role"], KubernetesMount: values["k8sAuthPath"], ServiceAccountTokenFile: filepath.Join(dir, "token")},
		Key:   crypt.TransitKey{Mount: values["transitMount"], Name: values["transitKey"]},
		CARef: values["caRef"],
	}
	if err := findCA(dir, kb, named["caRef"] != ""); err != nil {
		return nil, err
	}
	if err := nonEmptyFile("projected ServiceAccount token (audience vault)", "token", kb.Transit.ServiceAccountTokenFile); err != nil {
		return nil, err
	}
	return kb, nil
}

// keyBackendKeys are the keys of csi-key-backend-config in the key
// backend directory dir; none when dir does not exist. A key the node
// plugin does not know is refused.
func keyBackendKeys(dir string) ([]string, error) {
	if st, err := os.Stat(dir); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("key backend directory: %v", err)
	} else if !st.IsDir() {
		return nil, fmt.Errorf("key backend directory %s is not a directory", dir)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("key backend directory: %v", err)
	}
	known := map[string]bool{}
	var all []string
	for _, ks := range keySettings {
		for _, n := range ks.names {
			known[n] = true
			all = append(all, n)
		}
	}
	var given []string
	for _, e := range entries {
		n := e.Name()
		// The kubelet's own entries of a projected volume start with "..".
		if strings.HasPrefix(n, ".") || n == "token" || n == "ca" {
			continue
		}
		if !known[n] {
			return nil, fmt.Errorf("%s has key %s, which the node plugin does not know; the keys are %s (docs/encryption.md)",
				keyBackendConfig, n, strings.Join(all, ", "))
		}
		given = append(given, n)
	}
	return given, nil
}

// read is the setting's value in dir, normalised, and the name it was
// given under ("" when under none). Given under two names, the values
// must agree.
func (ks keySetting) read(dir string) (v, from string, err error) {
	for _, n := range ks.names {
		b, err := os.ReadFile(filepath.Join(dir, n))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return "", "", fmt.Errorf("%s key %s: %v", keyBackendConfig, n, err)
		}
		nv := ks.normal(strings.TrimSpace(string(b)))
		if from != "" {
			if nv != v {
				return "", "", fmt.Errorf("%s has both %s and %s, with different values; keep %s (the VCOCluster's name)",
					keyBackendConfig, from, n, ks.names[0])
			}
			continue
		}
		from, v = n, nv
	}
	return v, from, nil
}

// check is the setting's value v, read under the name from (none: ""),
// checked; a setting not given takes its default unless it is required.
// given are the keys of the ConfigMap, for the message.
func (ks keySetting) check(v, from string, given []string) (string, error) {
	switch {
	case from == "" && ks.required && ks.names[0] == "address":
		return "", fmt.Errorf("%s has key %s but no key address; set address to the Vault/OpenBao URL, e.g. https://openbao.example.net:8200",
			keyBackendConfig, given[0])
	case from == "" && ks.required:
		return "", fmt.Errorf("%s has no key %s; it is required with address", keyBackendConfig, ks.names[0])
	case from == "":
		return ks.def, nil
	case v == "" && ks.names[0] == "address":
		return "", fmt.Errorf("%s key address is empty; set it to the Vault/OpenBao URL, e.g. https://openbao.example.net:8200", keyBackendConfig)
	case v == "":
		return "", fmt.Errorf("%s key %s is empty; give it a value or remove the key", keyBackendConfig, from)
	case ks.mount && !mountPath.MatchString(v):
		return "", fmt.Errorf("%s key %s %q is not a path of letters, digits, '-', '_' and '.' segments", keyBackendConfig, from, v)
	case !ks.mount && ks.names[0] != "address" && ks.names[0] != "caRef" && strings.ContainsAny(v, " \t\r\n/"):
		return "", fmt.Errorf("%s key %s %q contains white space or '/'", keyBackendConfig, from, v)
	}
	return v, nil
}

// checkKeyBackendAddress refuses an address that is not scheme://host:port
// of https, or of http to a loopback address unless insecure
// (--insecure-allow-http) is set.
func checkKeyBackendAddress(addr string, insecure bool) error {
	u, err := url.Parse(addr)
	addr = quotable(addr)
	switch {
	case err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Hostname() == "":
		return fmt.Errorf("%s key address %q is not an http(s) URL with a host, e.g. https://openbao.example.net:8200", keyBackendConfig, addr)
	case u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.Fragment != "" || u.User != nil:
		return fmt.Errorf("%s key address %q has a path, query, fragment or user; want scheme://host:port only", keyBackendConfig, addr)
	case !cleartext.Allowed(u, insecure):
		return fmt.Errorf("%s key address %q is plain http to %s, not a loopback address: the node's ServiceAccount token, the Vault token and the volumes' passphrases would travel in clear; "+
			"set it to the https:// address, with the server's CA in openbao-ca (%s allows http for test set-ups)", keyBackendConfig, addr, u.Hostname(), cleartext.Option)
	}
	return nil
}

// findCA sets the CA bundle from the object caRef names: "name",
// "ConfigMap/name" or "Secret/name". The DaemonSet projects DefaultCARef
// only, as a ConfigMap and as a Secret; a caRef naming another object is
// served by the bundle delivered as DefaultCARef, and is a problem only
// when there is none. Without a caRef and a bundle the system roots are
// trusted.
func findCA(dir string, kb *keyBackend, explicit bool) error {
	kind, name := "", kb.CARef
	if k, n, ok := strings.Cut(kb.CARef, "/"); ok {
		switch strings.ToLower(k) {
		case "configmap":
			kind = "ConfigMap"
		case "secret":
			kind = "Secret"
		default:
			return fmt.Errorf("%s key caRef %q: the kind before '/' is neither ConfigMap nor Secret", keyBackendConfig, kb.CARef)
		}
		name = n
	}
	if !objectName.MatchString(name) {
		return fmt.Errorf("%s key caRef %q does not name a ConfigMap or Secret (want name, ConfigMap/name or Secret/name)", keyBackendConfig, kb.CARef)
	}
	for _, src := range caSources {
		if kind != "" && name == DefaultCARef && src.kind != kind {
			continue
		}
		for _, key := range caKeys {
			p := filepath.Join(dir, src.dir, key)
			b, err := os.ReadFile(p)
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			obj := src.kind + " " + DefaultCARef
			if err != nil {
				return fmt.Errorf("%s key %s: %v", obj, key, err)
			}
			if err := checkPEMCertificates(b); err != nil {
				return fmt.Errorf("%s key %s (%s): %v", obj, key, p, err)
			}
			kb.Transit.CACertFile, kb.CASource = p, obj+" key "+key
			return nil
		}
	}
	if explicit {
		where := "ConfigMap or Secret " + DefaultCARef
		if kind != "" && name == DefaultCARef {
			where = kind + " " + DefaultCARef
		}
		return fmt.Errorf("%s key caRef %q: no CA bundle found in the %s in namespace csi-driver under %s; "+
			"the node plugin reads the bundle delivered there, whatever object caRef names", keyBackendConfig, kb.CARef, where, strings.Join(caKeys, ", "))
	}
	return nil
}

// nodeKeyBackend reads the key backend directory and makes its transit
// client: nil, nil, nil when no key backend is configured.
func nodeKeyBackend(dir string, insecure bool) (*transit.Client, *keyBackend, error) {
	kb, err := loadKeyBackend(dir, insecure)
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
