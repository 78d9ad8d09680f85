package pkgbuild

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

func TestPackageVersion(t *testing.T) {
	good := map[string]string{
		"v1.2.3":                  "1.2.3",
		"1.2.3":                   "1.2.3",
		"v1.2.3-dirty":            "1.2.3.dirty",
		"v1.2.3-4-gabc1234":       "1.2.3+git4.abc1234",
		"v1.2.3-4-gabc1234-dirty": "1.2.3+git4.abc1234.dirty",
		"v1.2.3-rc1":              "1.2.3~rc1",
		"v1.2.3-rc1-2-gabc1234":   "1.2.3~rc1+git2.abc1234",
		"6fc9a0a":                 "0.0.0+git.6fc9a0a",
		"6fc9a0a-dirty":           "0.0.0+git.6fc9a0a.dirty",
		"  v0.1.0\n":              "0.1.0",
	}
	for in, want := range good {
		got, err := PackageVersion(in)
		if err != nil || got != want {
			t.Errorf("PackageVersion(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "dev", "v1.2", "release-1", "v1.2.3-foo", "XYZ1234"} {
		if got, err := PackageVersion(bad); err == nil {
			t.Errorf("PackageVersion(%q) = %q, want an error", bad, got)
		}
	}
}

// The versions must sort as the tags do, for dpkg and for rpm alike.
func TestPackageVersionOrder(t *testing.T) {
	ordered := []string{"6fc9a0a", "v0.9.0", "v1.0.0-rc1", "v1.0.0-rc1-3-gabc1234", "v1.0.0", "v1.0.0-2-gdef5678", "v1.0.1"}
	var vs []string
	for _, d := range ordered {
		v, err := PackageVersion(d)
		if err != nil {
			t.Fatal(err)
		}
		vs = append(vs, v)
	}
	for i := 1; i < len(vs); i++ {
		out, err := exec.Command("dpkg", "--compare-versions", vs[i-1], "lt", vs[i]).CombinedOutput()
		if err != nil {
			t.Errorf("dpkg: %s is not older than %s (%v %s)", vs[i-1], vs[i], err, out)
		}
		out, err = exec.Command("rpm", "--eval", "%{lua: print(rpm.vercmp('"+vs[i-1]+"', '"+vs[i]+"'))}").Output()
		if err != nil {
			t.Fatalf("rpm --eval: %v", err)
		}
		if strings.TrimSpace(string(out)) != "-1" {
			t.Errorf("rpm: %s is not older than %s (vercmp %s)", vs[i-1], vs[i], out)
		}
	}
}

const usage = `usage: vco-agent <command> [flags]

commands:
  events     print the agent's recent events
  identity   print this node's identity
  serve      run the agent
  version    print the agent version

Run 'vco-agent <command> --help' for a command's flags.`

func TestParseUsage(t *testing.T) {
	got := ParseUsage(usage)
	want := []Subcommand{
		{Name: "events", Summary: "print the agent's recent events"},
		{Name: "identity", Summary: "print this node's identity"},
		{Name: "serve", Summary: "run the agent"},
		{Name: "version", Summary: "print the agent version"},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("got %+v\nwant %+v", got, want)
	}
	if got := ParseUsage("no command list here\n"); len(got) != 0 {
		t.Fatalf("got %+v from text without a command list", got)
	}
}

// The man page must render without groff warnings even when help text
// holds roff control characters.
func TestManPageRenders(t *testing.T) {
	cmds := []Subcommand{
		{Name: "serve", Summary: "run the agent", Help: "Usage of serve:\n  -config string\n    \tconfig file (default \"/etc/vco-agent/config.yaml\")\n.leading dot\n'leading quote\nback\\slash"},
		{Name: "version", Summary: "print the agent version"},
	}
	page := ManPage("1.2.3", time.Date(2026, 11, 29, 0, 0, 0, 0, time.UTC), cmds)
	cmd := exec.Command("groff", "-man", "-Tutf8", "-ww", "-z")
	cmd.Stdin = bytes.NewReader(page)
	if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
		t.Fatalf("groff: %v\n%s", err, out)
	}
	cmd = exec.Command("groff", "-man", "-Tascii", "-P-c")
	cmd.Stdin = bytes.NewReader(page)
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	text := string(out)
	for _, want := range []string{".leading dot", "'leading quote", `back\slash`, "-config string", "print the agent version", "/etc/vco-agent/config.yaml"} {
		if !strings.Contains(text, want) {
			t.Errorf("rendered page lacks %q:\n%s", want, text)
		}
	}
}

func TestChangelog(t *testing.T) {
	got := string(Changelog("1.2.3", `A "B" <a@b>`, "v1.2.3", time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)))
	for _, want := range []string{`semver: "1.2.3-1"`, `date: "2026-11-29T12:00:00Z"`, `packager: "A \"B\" <a@b>"`, `note: "Built from v1.2.3."`} {
		if !strings.Contains(got, want) {
			t.Errorf("changelog lacks %q:\n%s", want, got)
		}
	}
}

// repoRoot is the repository root, two levels above this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// TestBuild packages a stand-in binary and checks, with dpkg-deb and rpm,
// that every file lands where nfpm.yaml says, with the right type.
func TestBuild(t *testing.T) {
	root := repoRoot(t)
	tmp := t.TempDir()
	bin := filepath.Join(tmp, "bin")
	gen := filepath.Join(tmp, "gen")
	out := filepath.Join(tmp, "out")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "vco-agent"), []byte("#!/bin/sh\necho stand-in\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	when := time.Date(2026, 11, 29, 0, 0, 0, 0, time.UTC)
	if err := Generate(gen, ManPage("1.2.3", when, nil), Changelog("1.2.3", "T <t@localhost>", "v1.2.3", when)); err != nil {
		t.Fatal(err)
	}
	paths, err := Build(Options{
		Root: root, Version: "1.2.3", Arch: "arm64", BinDir: bin, OutDir: out, Generated: gen,
		Maintainer: "T <t@localhost>", Homepage: "https://example.invalid", License: "Proprietary", MTime: when,
	})
	if err != nil {
		t.Fatal(err)
	}
	wantPaths := []string{filepath.Join(out, "vco-agent_1.2.3-1_arm64.deb"), filepath.Join(out, "vco-agent-1.2.3-1.aarch64.rpm")}
	if !slices.Equal(paths, wantPaths) {
		t.Fatalf("packages %v, want %v", paths, wantPaths)
	}

	common := []string{
		"/usr/bin/vco-agent",
		"/usr/lib/systemd/system/vco-agent.service",
		"/usr/lib/systemd/system/vco-agent.socket",
		"/usr/lib/tmpfiles.d/vco-agent.conf",
		"/usr/lib/sysusers.d/vco-agent.conf",
		"/usr/lib/modules-load.d/vco-agent.conf",
		"/usr/lib/udev/rules.d/60-vco-agent.rules",
		"/usr/share/dbus-1/system.d/cloud.whitesky.VcoAgent1.conf",
		"/etc/vco-agent/config.yaml",
		"/usr/share/man/man8/vco-agent.8.gz",
	}

	debFiles := run(t, "dpkg-deb", "--fsys-tarfile", paths[0])
	list := listTar(t, debFiles)
	for _, f := range append(common, "/usr/share/doc/vco-agent/copyright", "/usr/share/doc/vco-agent/changelog.Debian.gz", "/usr/share/lintian/overrides/vco-agent") {
		if !slices.Contains(list, f) {
			t.Errorf("deb lacks %s; has %v", f, list)
		}
	}
	if got := strings.TrimSpace(string(run(t, "dpkg-deb", "-f", paths[0], "Architecture"))); got != "arm64" {
		t.Errorf("deb Architecture %q", got)
	}
	conffiles := string(run(t, "sh", "-c", "dpkg-deb --ctrl-tarfile "+paths[0]+" | tar -xOf - ./conffiles"))
	if strings.TrimSpace(conffiles) != "/etc/vco-agent/config.yaml" {
		t.Errorf("deb conffiles %q", conffiles)
	}
	for _, script := range []string{"./postinst", "./prerm", "./postrm"} {
		if _, err := exec.Command("sh", "-c", "dpkg-deb --ctrl-tarfile "+paths[0]+" | tar -tf - "+script).Output(); err != nil {
			t.Errorf("deb lacks maintainer script %s", script)
		}
	}

	rpmList := strings.Fields(string(run(t, "rpm", "-qlp", paths[1])))
	for _, f := range append(common, "/usr/share/licenses/vco-agent/copyright", "/etc/vco-agent", "/usr/lib/systemd/system-preset/50-vco-agent.preset") {
		if !slices.Contains(rpmList, f) {
			t.Errorf("rpm lacks %s; has %v", f, rpmList)
		}
	}
	if got := strings.TrimSpace(string(run(t, "rpm", "-qcp", paths[1]))); got != "/etc/vco-agent/config.yaml" {
		t.Errorf("rpm config files %q", got)
	}
	scripts := string(run(t, "rpm", "-qp", "--scripts", paths[1]))
	for _, want := range []string{"preinstall scriptlet", "postinstall scriptlet", "preuninstall scriptlet", "postuninstall scriptlet", "groupadd -r vco-agent"} {
		if !strings.Contains(scripts, want) {
			t.Errorf("rpm scripts lack %q", want)
		}
	}
	if got := strings.TrimSpace(string(run(t, "rpm", "-qp", "--qf", "%{ARCH} %{VERSION}-%{RELEASE}", paths[1]))); got != "aarch64 1.2.3-1" {
		t.Errorf("rpm arch/version %q", got)
	}
	checkRelativePayload(t, paths[1], rpmList)
}

// checkRelativePayload: the RPM's payload names its members ./usr/...,
// as rpmbuild does, so that `rpm2cpio x.rpm | cpio -idm` unpacks into the
// current directory and never over this machine's root; its digests still verify, and what it unpacks is what rpm lists.
func checkRelativePayload(t *testing.T, rpm string, rpmList []string) {
	t.Helper()
	names := strings.Fields(string(run(t, "sh", "-c", "rpm2cpio "+rpm+" | cpio -t --quiet")))
	if len(names) == 0 {
		t.Fatal("rpm2cpio | cpio -t lists nothing")
	}
	for _, n := range names {
		if !strings.HasPrefix(n, "./") {
			// Fatal: the plain cpio -idm below would write it into /.
			t.Fatalf("payload member %q is not relative: rpm2cpio | cpio -id would write it outside the current directory", n)
		}
		if !slices.Contains(rpmList, strings.TrimPrefix(n, ".")) {
			t.Errorf("payload member %s is not in the package's file list", n)
		}
	}
	if out, err := exec.Command("rpm", "-Kv", "--nosignature", rpm).CombinedOutput(); err != nil || strings.Contains(string(out), "BAD") {
		t.Errorf("rpm -K: %v\n%s", err, out)
	}
	dir := t.TempDir()
	unpack := exec.Command("sh", "-c", "rpm2cpio "+rpm+" | cpio -idm --quiet")
	unpack.Dir = dir
	if out, err := unpack.CombinedOutput(); err != nil {
		t.Fatalf("rpm2cpio | cpio -idm: %v\n%s", err, out)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "usr/bin/vco-agent")); err != nil || !strings.Contains(string(b), "stand-in") {
		t.Errorf("the unpacked usr/bin/vco-agent: %q, %v", b, err)
	}
}

func TestBuildMissingSource(t *testing.T) {
	_, err := Build(Options{
		Root: repoRoot(t), Version: "1.2.3", Arch: "amd64", BinDir: t.TempDir(), OutDir: t.TempDir(), Generated: t.TempDir(),
		Maintainer: "T <t@localhost>", Homepage: "https://example.invalid", License: "Proprietary",
	})
	if err == nil || !strings.Contains(err.Error(), "vco-agent") || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("want an error naming the missing binary, got %v", err)
	}
}

func run(t *testing.T, name string, args ...string) []byte {
	t.Helper()
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			t.Fatalf("%s %v: %v\n%s", name, args, err, ee.Stderr)
		}
		t.Fatalf("%s %v: %v", name, args, err)
	}
	return out
}

// listTar returns the regular files and symlinks of a tar stream as
// absolute paths.
func listTar(t *testing.T, tarball []byte) []string {
	t.Helper()
	cmd := exec.Command("tar", "-tvf", "-")
	cmd.Stdin = bytes.NewReader(tarball)
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 || f[0][0] == 'd' {
			continue
		}
		files = append(files, strings.TrimPrefix(f[5], "."))
	}
	sort.Strings(files)
	return files
}

// On RHEL-family images the RPM's %post enables the units per the
// systemd presets, whose default is "disable *": the package must ship a
// preset that enables both units, as the .deb enables them. The units are unpacked from a built RPM into a root, and
// systemctl applies the presets there as %post does.
func TestRPMPresetEnablesTheUnits(t *testing.T) {
	root := repoRoot(t)
	tmp := t.TempDir()
	bin := filepath.Join(tmp, "bin")
	gen := filepath.Join(tmp, "gen")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "vco-agent"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	when := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	if err := Generate(gen, ManPage("1.2.3", when, nil), Changelog("1.2.3", "T <t@localhost>", "v1.2.3", when)); err != nil {
		t.Fatal(err)
	}
	paths, err := Build(Options{
		Root: root, Version: "1.2.3", Arch: "amd64", BinDir: bin, OutDir: filepath.Join(tmp, "out"), Generated: gen,
		Maintainer: "T <t@localhost>", Homepage: "https://example.invalid", License: "Proprietary", MTime: when,
	})
	if err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(tmp, "root")
	if err := os.MkdirAll(img, 0o755); err != nil {
		t.Fatal(err)
	}
	// A RHEL-family image's presets: everything not named is disabled.
	writeFile(t, filepath.Join(img, "usr/lib/systemd/system-preset/99-default.preset"), "disable *\n")
	for _, u := range []string{"multi-user.target", "sockets.target"} {
		writeFile(t, filepath.Join(img, "usr/lib/systemd/system", u), "[Unit]\nDescription="+u+"\n")
	}
	unpack := exec.Command("sh", "-c", "rpm2cpio "+paths[1]+" | cpio -idm --no-absolute-filenames --quiet")
	unpack.Dir = img
	if out, err := unpack.CombinedOutput(); err != nil {
		t.Fatalf("unpacking %s: %v\n%s", paths[1], err, out)
	}
	if out, err := exec.Command("systemctl", "--root="+img, "preset", "vco-agent.socket", "vco-agent.service").CombinedOutput(); err != nil {
		t.Fatalf("systemctl preset: %v\n%s", err, out)
	}
	for _, link := range []string{"etc/systemd/system/multi-user.target.wants/vco-agent.service", "etc/systemd/system/sockets.target.wants/vco-agent.socket"} {
		if _, err := os.Lstat(filepath.Join(img, link)); err != nil {
			t.Errorf("after the RPM's presets are applied, %s is missing: the unit stays disabled", link)
		}
	}
}
