// Command vco-addon builds the release artifacts of the vco-csi add-on:
// the manifest bundles csi.yaml and the opt-in csi-snapshots.yaml with
// their placeholders, renderings of them for one image and driver name,
// and the vco-csi container image as an OCI image layout tarball. Output
// goes to stdout unless -o names a file; notes go to stderr.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/whitesky-cloud/vco-storage/deploy"
)

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "bundle":
		err = runBundle(os.Args[2:])
	case "render":
		err = runRender(os.Args[2:])
	case "image":
		err = runImage(os.Args[2:])
	case "-h", "--help", "help":
		usage()
		return
	default:
		usage()
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "vco-addon %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprint(os.Stderr, `usage:
  vco-addon bundle [-part P] [-o FILE]  the manifests with their placeholders
  vco-addon render -image REF [-driver-name NAME] [-agent-gid GID] [-part P] [-o FILE]
                                        the manifests for one image; the driver
                                        name defaults to one derived from the
                                        image's registry host, the vco-agent
                                        group's gid to the packages' 573
      -part core       csi.yaml, what every cluster applies (the default)
      -part snapshots  csi-snapshots.yaml, the opt-in VolumeSnapshotClass;
                       needs the snapshot CRDs (docs/csi-addon.md)
      -part encryption csi-encryption.yaml, the opt-in encrypted class and
                       the key backend's token reviewer; only with a key
                       backend configured (docs/encryption.md)
      -part all        every part, core first, as one stream
      -part core,encryption  the parts named, in the order given
  vco-addon image -binary FILE -version V -o FILE.oci.tar
                                        the vco-csi image as an OCI layout tarball
`)
}

const partUsage = "which parts, comma-separated: core (csi.yaml), snapshots (csi-snapshots.yaml, needs the snapshot CRDs), " +
	"encryption (csi-encryption.yaml, needs a key backend) or all (every part, core first)"

// parts reads -part.
func parts(s string) ([]deploy.Part, error) {
	if s == "all" {
		return deploy.Parts(), nil
	}
	var out []deploy.Part
	for _, n := range strings.Split(s, ",") {
		p, err := deploy.ParsePart(n)
		if err != nil {
			return nil, fmt.Errorf("-part: %w, or all", err)
		}
		if slices.Contains(out, p) {
			return nil, fmt.Errorf("-part: %s is named twice", p)
		}
		out = append(out, p)
	}
	return out, nil
}

// bundle concatenates the parts' files, in order, into one stream.
func bundle(ps []deploy.Part) ([]byte, error) {
	var out []byte
	for _, p := range ps {
		b, err := deploy.BundleOf(p)
		if err != nil {
			return nil, err
		}
		out = append(out, b...)
	}
	return out, nil
}

func runBundle(args []string) error {
	fs := flag.NewFlagSet("bundle", flag.ContinueOnError)
	out := fs.String("o", "-", "output file (- for stdout)")
	part := fs.String("part", string(deploy.Core), partUsage)
	if err := fs.Parse(args); err != nil {
		return err
	}
	ps, err := parts(*part)
	if err != nil {
		return err
	}
	b, err := bundle(ps)
	if err != nil {
		return err
	}
	return write(*out, b)
}

func runRender(args []string) error {
	fs := flag.NewFlagSet("render", flag.ContinueOnError)
	image := fs.String("image", "", "vco-csi image reference, host/path/name:tag")
	name := fs.String("driver-name", "", "CSI driver name (default: derived from the image's registry host)")
	gidArg := fs.String("agent-gid", "", fmt.Sprintf("gid of the vco-agent group on the nodes (default %d, the packages' gid)", deploy.AgentGID))
	out := fs.String("o", "-", "output file (- for stdout)")
	part := fs.String("part", string(deploy.Core), partUsage)
	if err := fs.Parse(args); err != nil {
		return err
	}
	ps, err := parts(*part)
	if err != nil {
		return err
	}
	gid, err := deploy.ParseAgentGID(*gidArg)
	if err != nil {
		return err
	}
	if err := deploy.ValidateImage(*image); err != nil {
		return err
	}
	if *name == "" {
		n, err := deploy.DriverNameFromImage(*image)
		if err != nil {
			return err
		}
		*name = n
	}
	b, err := bundle(ps)
	if err != nil {
		return err
	}
	r, err := deploy.Render(b, deploy.Values{Image: *image, DriverName: *name, AgentGID: gid})
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "vco-addon: %s for image %s, driver name %s, vco-agent gid %d\n", *part, *image, *name, gid)
	return write(*out, r)
}

func write(path string, b []byte) error {
	if path == "-" {
		_, err := os.Stdout.Write(b)
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}
