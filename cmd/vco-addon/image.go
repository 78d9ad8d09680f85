package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/deploy/ociimage"
	"github.com/whitesky-cloud/vco-storage/internal/version"
)

// binaries collects -binary ARCH=FILE flags; a bare FILE is amd64.
type binaries map[string]string

func (b binaries) String() string { return fmt.Sprint(map[string]string(b)) }
func (b binaries) Set(s string) error {
	arch, file, ok := strings.Cut(s, "=")
	if !ok {
		arch, file = "amd64", s
	}
	if _, dup := b[arch]; dup {
		return fmt.Errorf("two binaries for %s", arch)
	}
	b[arch] = file
	return nil
}

func runImage(args []string) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	bins := binaries{}
	fs.Var(bins, "binary", "static vco-csi binary, ARCH=FILE (repeat per architecture; FILE alone is amd64)")
	describe := fs.String("version", "", "the release as `git describe --tags` gives it (v1.2.3); the image is tagged as its packages are versioned (1.2.3)")
	out := fs.String("o", "", "output tarball")
	outDir := fs.String("out-dir", "", "write DIR/vco-csi-TAG.oci.tar instead of -o")
	ca := fs.String("ca-bundle", "/etc/ssl/certs/ca-certificates.crt", "PEM CA bundle to install; empty for none")
	created := fs.String("created", "", "creation time, RFC 3339 (default: SOURCE_DATE_EPOCH, else the Unix epoch)")
	source := fs.String("source", "https://github.com/whitesky-cloud/vco-storage", "org.opencontainers.image.source label")
	if err := fs.Parse(args); err != nil {
		return err
	}
	tag, err := version.ImageTag(*describe)
	if err != nil {
		return fmt.Errorf("-version: %w", err)
	}
	switch {
	case *out == "" && *outDir == "":
		return fmt.Errorf("-o or -out-dir is required")
	case *out != "" && *outDir != "":
		return fmt.Errorf("-o and -out-dir exclude each other")
	case *outDir != "":
		*out = filepath.Join(*outDir, "vco-csi-"+tag+".oci.tar")
	}
	t, err := creationTime(*created)
	if err != nil {
		return err
	}
	o := ociimage.Options{Version: tag, Binaries: bins, CABundle: *ca, Created: t, Source: *source}
	if err := ociimage.WriteArchive(o, *out); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "vco-addon: wrote %s (vco-csi:%s, from %s, for %v)\n", *out, tag, *describe, bins)
	return nil
}

func creationTime(flagValue string) (time.Time, error) {
	if flagValue != "" {
		t, err := time.Parse(time.RFC3339, flagValue)
		if err != nil {
			return time.Time{}, fmt.Errorf("-created %q is not RFC 3339: %w", flagValue, err)
		}
		return t.UTC(), nil
	}
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		var sec int64
		if _, err := fmt.Sscan(s, &sec); err != nil {
			return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH=%q is not a number of seconds", s)
		}
		return time.Unix(sec, 0).UTC(), nil
	}
	return time.Unix(0, 0).UTC(), nil
}
