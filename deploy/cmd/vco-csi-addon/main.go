// Command vco-csi-addon writes the vco-csi add-on manifests (see package
// deploy): with -image, rendered for that image and the driver name derived
// from its registry host; without, the release artifact csi.yaml with the
// ${VCO_CSI_IMAGE} and ${VCO_CSI_DRIVER_NAME} placeholders for envsubst.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/whitesky-cloud/vco-storage/deploy"
)

func main() {
	image := flag.String("image", "", "vco-csi image, <registry host>/<path>[:tag]; empty keeps the placeholders")
	out := flag.String("out", "dist/csi.yaml", "output file")
	flag.Parse()
	var (
		text string
		err  error
	)
	if *image == "" {
		text, err = deploy.Bundle()
	} else {
		text, err = deploy.Render(*image)
	}
	if err == nil {
		err = os.MkdirAll(filepath.Dir(*out), 0o755)
	}
	if err == nil {
		err = os.WriteFile(*out, []byte(text), 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "vco-csi-addon:", err)
		os.Exit(1)
	}
	fmt.Println(*out)
}
