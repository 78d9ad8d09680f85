// Package deploy holds the Kubernetes manifests of the vco-csi add-on and
// renders them. The manifests under manifests/ are templates with exactly
// two placeholders, ${VCO_CSI_IMAGE} and ${VCO_CSI_DRIVER_NAME}, so that
// the release artifacts (their concatenations) can be filled in with
// envsubst by CAPVCO's ClusterResourceSet tooling, and by
// `make csi-addon` through Render. The add-on comes in parts: csi.yaml,
// which every cluster applies, the opt-in csi-snapshots.yaml
// (manifests/snapshots/), whose objects need the snapshot CRDs, and the
// opt-in csi-encryption.yaml (manifests/encryption/), the encrypted class
// and the token reviewer a key backend needs. The
// package exists so that the bundles, the rendering and the checks on
// them share one definition.
package deploy

import (
	"bytes"
	"embed"
	"fmt"
	"io/fs"
	"net"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/whitesky-cloud/vco-storage/csi/drivername"
	"github.com/whitesky-cloud/vco-storage/internal/kubeletpath"
)

// The placeholders the manifests carry, in envsubst's ${NAME} form.
const (
	ImageVar      = "VCO_CSI_IMAGE"
	DriverNameVar = "VCO_CSI_DRIVER_NAME"
)

// Namespace holds every namespaced object of the add-on.
const Namespace = "csi-driver"

// TopologyKey is the node label and CSI topology segment naming a
// whitesky.cloud location.
const TopologyKey = "cloud.whitesky/location"

// AgentNodeLabel marks the nodes whose image runs vco-agent; the node
// plugin's DaemonSet selects on it with the value "true", so that it never
// lands on a node without the agent, where it would wait forever on the
// agent's socket directory. The node image (kubelet --node-labels) or the
// operator sets it (docs/install.md).
const AgentNodeLabel = "cloud.whitesky/vco-agent"

// ImageUID is the unprivileged user (and group) the vco-csi image runs
// as, the conventional "nonroot" of distroless images.
const ImageUID = 65532

// AgentGID is the gid of the vco-agent group, whose members may call the
// agent's socket, as the vco-agent packages create it (packaging/): the
// node plugin's pod runs with it as a supplementary group. A node whose
// group has another gid (the packages found 573 taken, and said so) needs
// the add-on made with VCO_AGENT_GID (docs/csi-addon.md).
const AgentGID = 573

// AgentGIDVar is the name make csi-addon (and vco-addon render's
// -agent-gid) takes another gid of the vco-agent group by. It is no
// placeholder: the bundles carry AgentGID itself, in agentGroups, so that
// envsubst with the two names fills them in completely.
const AgentGIDVar = "VCO_AGENT_GID"

// agentGroups is the node pod's line that gives it the vco-agent group.
var agentGroups = fmt.Sprintf("supplementalGroups: [%d]", AgentGID)

// KeyBackendDir is where the node plugin finds the key backend's
// settings (ConfigMap csi-key-backend-config), its CA (ConfigMap or
// Secret openbao-ca, keys ca.crt, ca.pem or ca-bundle.crt, under
// ca/configmap/ and ca/secret/) and a projected service account token
// (token).
const KeyBackendDir = "/etc/vco-csi/key-backend"

//go:embed manifests/*.yaml manifests/snapshots/*.yaml manifests/encryption/*.yaml
var manifests embed.FS

// Part is a piece of the add-on applied on its own.
type Part string

const (
	// Core is csi.yaml, what every cluster applies: it holds no object
	// whose kind the cluster may lack, so kubectl apply and a
	// ClusterResourceSet succeed on a cluster without the snapshot CRDs.
	Core Part = "core"
	// Snapshots is csi-snapshots.yaml, the opt-in VolumeSnapshotClass,
	// applied after Core on a cluster with the snapshot CRDs and
	// snapshot-controller.
	Snapshots Part = "snapshots"
	// Encryption is csi-encryption.yaml, the opt-in encrypted
	// StorageClass and the token reviewer of the key backend's Kubernetes
	// auth, applied after Core on a cluster whose key backend is
	// configured (docs/encryption.md): a class whose every volume would
	// be refused is not shipped by default.
	Encryption Part = "encryption"
)

// Parts lists the parts in the order they are applied.
func Parts() []Part { return []Part{Core, Snapshots, Encryption} }

// ParsePart reads a part's name as the command line gives it.
func ParsePart(s string) (Part, error) {
	for _, p := range Parts() {
		if string(p) == s {
			return p, nil
		}
	}
	return "", fmt.Errorf("unknown part %q; the parts are %s, %s and %s", s, Core, Snapshots, Encryption)
}

// FileName is the part's file in deploy/ and in a release.
func (p Part) FileName() string {
	if p == Core {
		return "csi.yaml"
	}
	return "csi-" + string(p) + ".yaml"
}

func (p Part) glob() string {
	if p == Core {
		return "manifests/*.yaml"
	}
	return "manifests/" + string(p) + "/*.yaml"
}

// header opens a part's file; it says how to fill the placeholders.
func (p Part) header() string {
	h := `# vco-csi add-on for whitesky.cloud Kubernetes clusters.
# Generated from deploy/manifests by ` + "`make csi-yaml`" + `; do not edit.
# Two placeholders, VCO_CSI_IMAGE and VCO_CSI_DRIVER_NAME, are filled in
# by envsubst (or make csi-addon); no other variable appears. The Secret
# and ConfigMaps the add-on reads are described in docs/csi-addon.md.
`
	if p == Core {
		h += `# The node plugin's pod runs with gid 573, the vco-agent group's as
# the node packages make it (supplementalGroups); for nodes whose group
# has another gid, make csi-addon VCO_AGENT_GID=<gid> writes that one.
`
	}
	if p == Snapshots {
		h += `# This is the opt-in snapshots part: apply it after csi.yaml, and only
# on a cluster with the snapshot CRDs and snapshot-controller of
# kubernetes-csi/external-snapshotter (docs/csi-addon.md, "Snapshots").
`
	}
	if p == Encryption {
		h += `# This is the opt-in encryption part: apply it after csi.yaml, on a
# cluster whose key backend is configured (the ConfigMaps
# csi-key-backend-config and openbao-ca; docs/encryption.md).
`
	}
	return h
}

// Files lists the core part's manifest templates in the order they are
// applied.
func Files() ([]string, error) { return FilesOf(Core) }

// FilesOf lists a part's manifest templates in the order they are applied.
func FilesOf(p Part) ([]string, error) {
	names, err := fs.Glob(manifests, p.glob())
	if err != nil {
		return nil, err
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("part %s has no manifests", p)
	}
	sort.Strings(names)
	return names, nil
}

// Bundle returns csi.yaml, the core part.
func Bundle() ([]byte, error) { return BundleOf(Core) }

// BundleOf returns a part's file: every manifest template of the part,
// in order, as one multi-document YAML stream with the placeholders
// still in it.
func BundleOf(p Part) ([]byte, error) {
	names, err := FilesOf(p)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	b.WriteString(p.header())
	for _, n := range names {
		data, err := manifests.ReadFile(n)
		if err != nil {
			return nil, err
		}
		data = bytes.TrimPrefix(data, []byte("---\n"))
		fmt.Fprintf(&b, "---\n# Source: deploy/%s\n", n)
		b.Write(data)
		if !bytes.HasSuffix(data, []byte("\n")) {
			b.WriteByte('\n')
		}
	}
	return b.Bytes(), nil
}

// Values fill the placeholders.
type Values struct {
	Image      string
	DriverName string
	// AgentGID, when not 0, replaces the node pod's vco-agent gid
	// (AgentGID) for nodes whose group has another.
	AgentGID int64
}

// ParseAgentGID reads a gid of the vco-agent group as make csi-addon
// takes it: empty for AgentGID, or a number that is not root's group.
func ParseAgentGID(s string) (int64, error) {
	if s == "" {
		return AgentGID, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 || n > 4294967294 {
		return 0, fmt.Errorf("%s=%q is not a gid: give the vco-agent group's number on the nodes (getent group vco-agent), not 0", AgentGIDVar, s)
	}
	return n, nil
}

// Render substitutes the placeholders in a template such as Bundle's
// output, as envsubst restricted to the two names would. It refuses
// values that would not survive in the YAML unquoted, and a template that
// still holds any other ${...} or $NAME reference, which envsubst without
// a name list would blank.
func Render(template []byte, v Values) ([]byte, error) {
	if err := ValidateImage(v.Image); err != nil {
		return nil, err
	}
	if err := ValidateDriverName(v.DriverName); err != nil {
		return nil, err
	}
	if refs := ForeignRefs(template); len(refs) > 0 {
		return nil, fmt.Errorf("template refers to %s; only ${%s} and ${%s} are filled in", strings.Join(refs, ", "), ImageVar, DriverNameVar)
	}
	if v.AgentGID < 0 || v.AgentGID > 4294967294 {
		return nil, fmt.Errorf("vco-agent gid %d is out of range", v.AgentGID)
	}
	out := bytes.ReplaceAll(template, []byte("${"+ImageVar+"}"), []byte(v.Image))
	out = bytes.ReplaceAll(out, []byte("${"+DriverNameVar+"}"), []byte(v.DriverName))
	if v.AgentGID != 0 {
		out = bytes.ReplaceAll(out, []byte(agentGroups), fmt.Appendf(nil, "supplementalGroups: [%d]", v.AgentGID))
	}
	return out, nil
}

var shellRef = regexp.MustCompile(`\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*`)

// ForeignRefs lists the shell-style variable references in a template
// other than the two placeholders. Kubernetes' own $(NAME) references
// are not shell-style and are left alone.
func ForeignRefs(template []byte) []string {
	seen := map[string]bool{}
	var out []string
	for _, m := range shellRef.FindAll(template, -1) {
		s := string(m)
		if s == "${"+ImageVar+"}" || s == "${"+DriverNameVar+"}" || seen[s] {
			continue
		}
		seen[s] = true
		out = append(out, s)
	}
	return out
}

var (
	// An image reference as YAML can carry it unquoted.
	imageRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9._:/]*[a-zA-Z0-9_])?(@sha256:[0-9a-f]{64})?$`)
)

// ValidateDriverName checks a name as Kubernetes checks a CSIDriver's.
func ValidateDriverName(name string) error {
	if name == "" {
		return fmt.Errorf("driver name is empty: set %s", DriverNameVar)
	}
	if !kubeletpath.DriverName(name) {
		return fmt.Errorf("driver name %q is not a DNS subdomain of at most 63 lowercase characters", name)
	}
	return nil
}

// ValidateImage checks that an image reference names a repository on a
// registry host and, optionally, a tag or digest.
func ValidateImage(image string) error {
	if image == "" {
		return fmt.Errorf("image is empty: set %s, e.g. try.whitesky.cloud/vco/csi:1.0", ImageVar)
	}
	repo := image
	if i := strings.Index(repo, "@"); i >= 0 {
		repo = repo[:i]
	}
	if !imageRE.MatchString(strings.ToLower(repo)) || strings.Contains(image, "//") {
		return fmt.Errorf("image %q is not an image reference like host/path/name:tag", image)
	}
	return nil
}

// ImageHost returns the registry host of an image reference, without a
// port: the part before the first slash, when that part names a host
// (it holds a dot or a port, or is localhost), as container tools read
// it. A reference without one (vco/csi:1.0) has no host.
func ImageHost(image string) (string, error) {
	first, _, ok := strings.Cut(image, "/")
	if !ok || !(strings.ContainsAny(first, ".:") || first == "localhost") {
		return "", fmt.Errorf("image %q names no registry host; give one (host/path/name:tag) or set %s", image, DriverNameVar)
	}
	host := first
	if h, _, err := net.SplitHostPort(first); err == nil {
		host = h
	}
	return strings.ToLower(strings.Trim(host, "[]")), nil
}

// DriverNameFromImage derives the CSI driver name from the image's
// registry host the way the portal host gives it: reverse the domain and
// replace the leaf (the leftmost label) with "csi", so an image on
// try.whitesky.cloud gives cloud.whitesky.csi and one on
// registry.try.whitesky.cloud gives cloud.whitesky.try.csi. A host that is
// an IP address, localhost or a single label has no domain to derive
// from.
func DriverNameFromImage(image string) (string, error) {
	host, err := ImageHost(image)
	if err != nil {
		return "", err
	}
	// The plugin's own rule, so the add-on and a plugin started without
	// --driver-name agree.
	name := drivername.FromPortal(host)
	if name == "" {
		return "", fmt.Errorf("image host %q is not a domain name, so no driver name follows from it; set %s", host, DriverNameVar)
	}
	if err := ValidateDriverName(name); err != nil {
		return "", fmt.Errorf("image host %q: %w; set %s", host, err, DriverNameVar)
	}
	return name, nil
}
