// Command vco-addon builds the release artifacts of the vco-csi add-on:
// the manifest bundle csi.yaml with its placeholders, a rendering of it
// for one image and driver name, and the vco-csi container image as an
// OCI image layout tarball.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

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
  vco-addon bundle [-o csi.yaml]        the manifests with their placeholders
  vco-addon render -image REF [-driver-name NAME] [-o FILE]
                                        the manifests for one image; the driver
                                        name defaults to one derived from the
                                        image's registry host
  vco-addon image -binary FILE -version V -o FILE.oci.tar
                                        the vco-csi image as an OCI layout tarball
`)
}

func runBundle(args []string) error {
	fs := flag.NewFlagSet("bundle", flag.ContinueOnError)
	out := fs.String("o", "-", "output file (- for stdout)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	b, err := deploy.Bundle()
	if err != nil {
		return err
	}
	return write(*out, b)
}

func runRender(args []string) error {
	fs := flag.NewFlagSet("render", flag.ContinueOnError)
	image := fs.String("image", "", "vco-csi image reference, host/path/name:tag")
	name := fs.String("driver-name", "", "CSI driver name (default: derived from the image's registry host)")
	out := fs.String("o", "-", "output file (- for stdout)")
	if err := fs.Parse(args); err != nil {
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
	b, err := deploy.Bundle()
	if err != nil {
		return err
	}
	r, err := deploy.Render(b, deploy.Values{Image: *image, DriverName: *name})
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "vco-addon: image %s, driver name %s\n", *image, *name)
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
