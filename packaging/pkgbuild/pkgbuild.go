// Package pkgbuild builds the vco-agent .deb and .rpm from
// packaging/nfpm.yaml with nfpm used as a library, so that no
// dpkg-buildpackage or rpmbuild toolchain is needed to make node-image
// packages. It also derives what nfpm does not: a package version from
// `git describe`, a reproducible Debian changelog, and the man page, which
// is rendered from the binary's own help so it covers every subcommand.
package pkgbuild

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/goreleaser/nfpm/v2"
	_ "github.com/goreleaser/nfpm/v2/deb" // registers the deb packager
	_ "github.com/goreleaser/nfpm/v2/rpm" // registers the rpm packager

	"github.com/whitesky-cloud/vco-storage/internal/version"
)

// Formats are the package formats Build writes, in order.
var Formats = []string{"deb", "rpm"}

// Options says what to package and where.
type Options struct {
	// Root is the repository root; nfpm.yaml's relative paths are taken
	// from it.
	Root string
	// Version is the package version (see PackageVersion).
	Version string
	// Arch is a Go architecture: amd64 or arm64.
	Arch string
	// BinDir holds the vco-agent binary built for Arch.
	BinDir string
	// OutDir receives the packages.
	OutDir string
	// Generated holds the man page and changelog (see Generate).
	Generated string
	// Config is the default config.yaml to ship (the upgrade check ships
	// a changed one); empty means packaging/config.yaml.
	Config string
	// UdevRules is the rules file to ship; empty means the packaging
	// placeholder.
	UdevRules  string
	Maintainer string
	Homepage   string
	License    string
	// MTime stamps every file, for reproducible packages.
	MTime time.Time
}

// Build writes one package per format for o.Arch and returns their paths.
func Build(o Options) ([]string, error) {
	vars, err := o.vars()
	if err != nil {
		return nil, err
	}
	// nfpm resolves relative sources against the working directory.
	wd, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	if err := os.Chdir(o.Root); err != nil {
		return nil, fmt.Errorf("repository root: %w", err)
	}
	defer os.Chdir(wd) //nolint:errcheck // best effort; the process exits after a build

	// Every source must exist: nfpm's own message for a missing file does
	// not say which package entry wanted it.
	for _, p := range []string{filepath.Join(o.BinDir, "vco-agent"), o.Config, o.UdevRules, "agent/dbus/cloud.whitesky.VcoAgent1.conf"} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("package source %s: %w", p, err)
		}
	}

	cfg, err := nfpm.ParseFileWithEnvMapping("packaging/nfpm.yaml", func(k string) string {
		v, ok := vars[k]
		if !ok {
			// An unknown ${NAME} in nfpm.yaml is a mistake, not an
			// environment lookup.
			return "${" + k + "}"
		}
		return v
	})
	if err != nil {
		return nil, fmt.Errorf("packaging/nfpm.yaml: %w", err)
	}
	// nfpm expands no variables in these fields.
	cfg.License = o.License
	cfg.Changelog = filepath.Join(o.Generated, "changelog.yaml")
	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return nil, err
	}
	var out []string
	for _, format := range Formats {
		path, err := buildFormat(&cfg, format, o)
		if err != nil {
			return nil, err
		}
		out = append(out, path)
	}
	return out, nil
}

// vars are the values of the ${NAME}s of packaging/nfpm.yaml, from o with
// its defaults filled in; none may be empty.
func (o *Options) vars() (map[string]string, error) {
	if o.Config == "" {
		o.Config = "packaging/config.yaml"
	}
	if o.UdevRules == "" {
		o.UdevRules = "packaging/udev/60-vco-agent.rules"
	}
	vars := map[string]string{
		"ARCH":       o.Arch,
		"VERSION":    o.Version,
		"BIN":        o.BinDir,
		"GENERATED":  o.Generated,
		"CONFIG":     o.Config,
		"UDEV_RULES": o.UdevRules,
		"MAINTAINER": o.Maintainer,
		"HOMEPAGE":   o.Homepage,
		"LICENSE":    o.License,
	}
	for k, v := range vars {
		if v == "" {
			return nil, fmt.Errorf("package option %s is empty", k)
		}
	}
	return vars, nil
}

// buildFormat writes the package of one format into o.OutDir and returns
// its path.
func buildFormat(cfg *nfpm.Config, format string, o Options) (string, error) {
	info, err := cfg.Get(format)
	if err != nil {
		return "", err
	}
	info.MTime = o.MTime
	info = nfpm.WithDefaults(info)
	packager, err := nfpm.Get(format)
	if err != nil {
		return "", err
	}
	if err := nfpm.PrepareForPackager(info, format); err != nil {
		return "", fmt.Errorf("%s package: %w", format, err)
	}
	for _, c := range info.Contents {
		if strings.Contains(c.Source, "${") || strings.Contains(c.Destination, "${") {
			return "", fmt.Errorf("packaging/nfpm.yaml: unexpanded variable in %s -> %s", c.Source, c.Destination)
		}
	}
	path := filepath.Join(o.OutDir, packager.ConventionalFileName(info))
	if err := writePackage(packager, info, path); err != nil {
		return "", fmt.Errorf("%s package %s: %w", format, path, err)
	}
	if format == "rpm" {
		if err := relativePayload(path); err != nil {
			return "", fmt.Errorf("rpm package %s: making its payload's member names relative: %w", path, err)
		}
	}
	return path, nil
}

func writePackage(p nfpm.Packager, info *nfpm.Info, path string) error {
	f, err := os.Create(path + ".tmp")
	if err != nil {
		return err
	}
	if err := p.Package(info, f); err != nil {
		f.Close()
		os.Remove(f.Name())
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// PackageVersion is the package version of a `git describe` output
// (version.Package; the image tag is version.ImageTag of the same).
func PackageVersion(describe string) (string, error) { return version.Package(describe) }

// gzipBytes compresses like `gzip -9n`: no name or time in the header, so
// the packages are reproducible and lintian accepts the files.
func gzipBytes(b []byte) []byte {
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	zw.Write(b) //nolint:errcheck // writes to a bytes.Buffer do not fail
	zw.Close()
	return buf.Bytes()
}

// Changelog returns a one-entry changelog in nfpm's (chglog) YAML format,
// from which nfpm writes the Debian changelog and the RPM changelog tags.
// Strings are JSON-quoted, which YAML reads as they are.
func Changelog(version, maintainer, source string, when time.Time) []byte {
	q := strconv.Quote
	return fmt.Appendf(nil, `- semver: %s
  date: %s
  packager: %s
  deb:
    urgency: medium
    distributions: [unstable]
  changes:
    - note: %s
`, q(version+"-1"), q(when.UTC().Format(time.RFC3339)), q(maintainer), q("Built from "+source+"."))
}

// Generate writes the man page and the Debian changelog into dir.
func Generate(dir string, man, changelog []byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return errors.Join(
		os.WriteFile(filepath.Join(dir, "vco-agent.8.gz"), gzipBytes(man), 0o644),
		os.WriteFile(filepath.Join(dir, "changelog.yaml"), changelog, 0o644),
	)
}
