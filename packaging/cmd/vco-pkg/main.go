// Command vco-pkg builds the vco-agent .deb and .rpm packages for each
// requested architecture (see packaging/pkgbuild). `make packages` runs it.
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

	"github.com/whitesky-cloud/vco-storage/packaging/pkgbuild"
)

func main() {
	var (
		describe   = flag.String("version", "", "`git describe --tags --always --dirty` of the tree being packaged")
		arches     = flag.String("arch", "amd64,arm64", "comma-separated Go architectures")
		binDir     = flag.String("bin-dir", "bin/linux_%s", "directory of each architecture's vco-agent (%s is the architecture)")
		hostBin    = flag.String("help-from", "bin/vco-agent", "host-architecture vco-agent whose help becomes the man page")
		outDir     = flag.String("out", "dist", "output directory")
		workDir    = flag.String("work", "dist/.work", "directory for generated files")
		config     = flag.String("config", "", "default config.yaml to ship (default packaging/config.yaml)")
		udevRules  = flag.String("udev-rules", "", "udev rules to ship (default the packaging placeholder)")
		maintainer = flag.String("maintainer", "", "package maintainer, \"Name <address>\"")
		homepage   = flag.String("homepage", "https://github.com/whitesky-cloud/vco-storage", "project homepage")
		license    = flag.String("license", "Proprietary", "license of the packaged software")
	)
	flag.Parse()
	if err := run(*describe, *arches, *binDir, *hostBin, *outDir, *workDir, *config, *udevRules, *maintainer, *homepage, *license); err != nil {
		fmt.Fprintln(os.Stderr, "vco-pkg:", err)
		os.Exit(1)
	}
}

func run(describe, arches, binDir, hostBin, outDir, workDir, config, udevRules, maintainer, homepage, license string) error {
	version, err := pkgbuild.PackageVersion(describe)
	if err != nil {
		return err
	}
	if maintainer == "" {
		return fmt.Errorf("-maintainer is required")
	}
	mtime, err := sourceDate()
	if err != nil {
		return err
	}
	cmds, err := pkgbuild.HelpFromBinary(hostBin)
	if err != nil {
		return err
	}
	changelog := pkgbuild.Changelog(version, maintainer, describe, mtime)
	if err := pkgbuild.Generate(workDir, pkgbuild.ManPage(version, mtime, cmds), changelog); err != nil {
		return err
	}
	root, err := os.Getwd()
	if err != nil {
		return err
	}
	for _, arch := range strings.Split(arches, ",") {
		paths, err := pkgbuild.Build(pkgbuild.Options{
			Root:       root,
			Version:    version,
			Arch:       arch,
			BinDir:     fmt.Sprintf(binDir, arch),
			OutDir:     outDir,
			Generated:  workDir,
			Config:     config,
			UdevRules:  udevRules,
			Maintainer: maintainer,
			Homepage:   homepage,
			License:    license,
			MTime:      mtime,
		})
		if err != nil {
			return fmt.Errorf("%s: %w", arch, err)
		}
		for _, p := range paths {
			fmt.Println(filepath.Clean(p))
		}
	}
	return nil
}

// sourceDate is SOURCE_DATE_EPOCH when set, else the last commit's time,
// so two builds of one commit are byte-identical.
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
