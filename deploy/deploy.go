// Package deploy holds the Kubernetes manifests of the vco-csi add-on and
// renders them. The release artifact csi.yaml keeps the placeholders
// ${VCO_CSI_IMAGE} and ${VCO_CSI_DRIVER_NAME} for envsubst (CAPVCO delivers
// it with a ClusterResourceSet); Render fills them in, deriving the driver
// name from the image's registry host with the rule the plugin applies to
// the portal host (driver.NameFromPortal).
package deploy

import (
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strings"

	"github.com/whitesky-cloud/vco-storage/csi/driver"
)

//go:embed [0-9][0-9]-*.yaml
var manifests embed.FS

// Namespace is where every namespaced object of the add-on lives.
const Namespace = "csi-driver"

// Placeholders in the manifests.
const (
	ImagePlaceholder      = "${VCO_CSI_IMAGE}"
	DriverNamePlaceholder = "${VCO_CSI_DRIVER_NAME}"
)

// Bundle returns every manifest, in file-name order, as one multi-document
// YAML stream with the placeholders in place.
func Bundle() (string, error) {
	names, err := fs.Glob(manifests, "*.yaml")
	if err != nil {
		return "", err
	}
	sort.Strings(names)
	var b strings.Builder
	b.WriteString("# vco-csi add-on. Placeholders for envsubst: ${VCO_CSI_IMAGE}, ${VCO_CSI_DRIVER_NAME}.\n")
	for _, n := range names {
		data, err := manifests.ReadFile(n)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(&b, "---\n# %s\n", n)
		b.Write(data)
	}
	return b.String(), nil
}

// ImageHost returns the registry host of an image reference.
func ImageHost(image string) (string, error) {
	host, _, ok := strings.Cut(image, "/")
	if !ok || !(strings.ContainsAny(host, ".:") || host == "localhost") {
		return "", fmt.Errorf("image %q names no registry host (want <host>/<path>[:tag])", image)
	}
	return host, nil
}

// Render fills in the image and the driver name derived from its host.
func Render(image string) (string, error) {
	host, err := ImageHost(image)
	if err != nil {
		return "", err
	}
	name := driver.NameFromPortal(host)
	if name == "" {
		return "", fmt.Errorf("image %q: cannot derive a driver name from host %q (want a DNS name such as registry.whitesky.cloud)", image, host)
	}
	bundle, err := Bundle()
	if err != nil {
		return "", err
	}
	return strings.NewReplacer(ImagePlaceholder, image, DriverNamePlaceholder, name).Replace(bundle), nil
}
