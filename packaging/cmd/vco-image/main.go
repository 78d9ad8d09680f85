// Command vco-image writes the vco-csi container image as an OCI archive
// (see packaging/ociimage). `make image` runs it.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/packaging/ociimage"
)

func main() {
	var (
		version = flag.String("version", "", "image version (`git describe` of the tree), also its ref name in the archive")
		arches  = flag.String("arch", "amd64,arm64", "comma-separated Go architectures")
		binDir  = flag.String("bin-dir", "bin/linux_%s", "directory of each architecture's vco-csi (%s is the architecture)")
		caCerts = flag.String("ca-certs", "/etc/ssl/certs/ca-certificates.crt", "PEM CA bundle to install in the image")
		outDir  = flag.String("out", "dist", "output directory")
		source  = flag.String("source", "https://github.com/whitesky-cloud/vco-storage", "org.opencontainers.image.source label")
	)
	flag.Parse()
	if err := run(*version, *arches, *binDir, *caCerts, *outDir, *source); err != nil {
		fmt.Fprintln(os.Stderr, "vco-image:", err)
		os.Exit(1)
	}
}

func run(version, arches, binDir, caCerts, outDir, source string) error {
	if version == "" || strings.ContainsAny(version, "/: +") {
		return fmt.Errorf("-version %q: want a non-empty tag (letters, digits, '.', '_', '-')", version)
	}
	created, err := sourceDate()
	if err != nil {
		return err
	}
	bins := map[string]string{}
	for _, a := range strings.Split(arches, ",") {
		bins[a] = filepath.Join(fmt.Sprintf(binDir, a), "vco-csi")
	}
	idx, err := ociimage.Build(ociimage.Options{Version: version, Binaries: bins, CACerts: caCerts, Created: created, Source: source})
	if err != nil {
		return err
	}
	out := filepath.Join(outDir, "vco-csi-"+version+".oci.tar")
	if err := ociimage.WriteArchive(idx, version, out, created); err != nil {
		return fmt.Errorf("%s: %w", out, err)
	}
	fmt.Println(out)
	return nil
}

// sourceDate is SOURCE_DATE_EPOCH when set, else the last commit's time.
func sourceDate() (time.Time, error) {
	s := os.Getenv("SOURCE_DATE_EPOCH")
	if s == "" {
		out, err := exec.Command("git", "log", "-1", "--format=%ct").Output()
		if err != nil {
			return time.Time{}, fmt.Errorf("no SOURCE_DATE_EPOCH and no git commit time: %w", err)
		}
		s = strings.TrimSpace(string(out))
	}
	sec, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", s, err)
	}
	return time.Unix(sec, 0).UTC(), nil
}
