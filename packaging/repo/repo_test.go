package repo

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"encoding/xml"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// deb822 reads one deb822 stanza (an apt .sources file): "Field: value",
// continuation lines starting with a space, "." standing for an empty
// line, comments ignored. A continued value is its lines joined by "\n".
func deb822(t *testing.T, b []byte) map[string]string {
	t.Helper()
	f := map[string]string{}
	var last string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
			continue
		case strings.HasPrefix(line, " "):
			if last == "" {
				t.Fatalf("continuation line %q before any field", line)
			}
			v := strings.TrimPrefix(line, " ")
			if v == "." {
				v = ""
			}
			if f[last] != "" {
				v = "\n" + v
			}
			f[last] += v
		default:
			k, v, ok := strings.Cut(line, ":")
			if !ok {
				t.Fatalf("line %q is neither a field nor a continuation", line)
			}
			last = k
			f[k] = strings.TrimSpace(v)
		}
	}
	return f
}

// repoFile reads the one section of a yum .repo file.
func repoFile(t *testing.T, b []byte) (string, map[string]string) {
	t.Helper()
	var section string
	f := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]"):
			if section != "" {
				t.Fatalf("more than one section: %s and %s", section, line)
			}
			section = strings.Trim(line, "[]")
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok || section == "" {
				t.Fatalf("line %q is not key=value in a section", line)
			}
			f[k] = v
		}
	}
	return section, f
}

// userData is the part of the repository's cloud-init user-data the
// checks read.
type userData struct {
	WriteFiles []map[string]string `yaml:"write_files"`
	RunCmd     [][]string          `yaml:"runcmd"`
	Apt        struct {
		Sources map[string]struct {
			Source string `yaml:"source"`
			Key    string `yaml:"key"`
			KeyID  string `yaml:"keyid"`
		} `yaml:"sources"`
	} `yaml:"apt"`
	YumRepos map[string]map[string]any `yaml:"yum_repos"`
	Packages []string                  `yaml:"packages"`
}

// imageBuilderVars is an image-builder variables file; unknown fields are
// an error.
type imageBuilderVars struct {
	ExtraRepos string `json:"extra_repos"`
	ExtraDebs  string `json:"extra_debs"`
	ExtraRpms  string `json:"extra_rpms"`
}

func read(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func readVars(t *testing.T, path string) imageBuilderVars {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(read(t, path)))
	dec.DisallowUnknownFields()
	var v imageBuilderVars
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return v
}

func readUserData(t *testing.T, b []byte) userData {
	t.Helper()
	var u userData
	if err := yaml.Unmarshal(b, &u); err != nil {
		t.Fatalf("user-data: %v", err)
	}
	return u
}

const (
	urlVar = "${VCO_REPO_URL}"
	keyVar = "${VCO_REPO_KEY}"
)

// The templates make-repo.sh renders: apt trusts the key for this
// repository alone (Signed-By, never trusted=yes), dnf checks the metadata
// and every package, cloud-init installs vco-agent from the same
// repository as the two files name, and image-builder's variables name
// those files and the package.
func TestTemplates(t *testing.T) {
	src := deb822(t, read(t, "vco-storage.sources"))
	want := map[string]string{"Types": "deb", "URIs": urlVar + "/apt", "Suites": Suite, "Components": Component, "Signed-By": keyVar}
	if !reflect.DeepEqual(src, want) {
		t.Errorf("vco-storage.sources has %q, want %q", src, want)
	}

	section, repo := repoFile(t, read(t, "vco-storage.repo"))
	wantRepo := map[string]string{"name": "vco-storage node packages", "baseurl": urlVar + "/yum", "enabled": "1",
		"gpgcheck": "1", "repo_gpgcheck": "1", "gpgkey": urlVar + "/" + Keyring + ".asc"}
	if section != "vco-storage" || !reflect.DeepEqual(repo, wantRepo) {
		t.Errorf("vco-storage.repo has [%s] %q, want [vco-storage] %q", section, repo, wantRepo)
	}

	seed := read(t, "../cloud-init/user-data.yaml")
	part := read(t, "../cloud-init/repository.yaml")
	u := readUserData(t, append(append([]byte{}, seed...), part...))
	checkUserDataRepository(t, u, urlVar+"/apt", keyVar, repo)

	for file, want := range map[string]imageBuilderVars{
		"vco-agent-deb.json": {ExtraRepos: "${VCO_REPO_DIR}/vco-storage.sources", ExtraDebs: Package},
		"vco-agent-rpm.json": {ExtraRepos: "${VCO_REPO_DIR}/vco-storage.repo", ExtraRpms: Package},
	} {
		if got := readVars(t, filepath.Join("..", "..", "deploy", "image-builder", file)); got != want {
			t.Errorf("deploy/image-builder/%s is %+v, want %+v", file, got, want)
		}
	}
}

// checkUserDataRepository: the user-data adds one apt source, at aptURL
// with the stable suite's main component, signed by key alone; one yum
// repository with the .repo file's settings; and installs vco-agent.
func checkUserDataRepository(t *testing.T, u userData, aptURL, key string, repo map[string]string) {
	t.Helper()
	if len(u.Apt.Sources) != 1 {
		t.Fatalf("user-data has apt sources %v, want one", u.Apt.Sources)
	}
	for name, s := range u.Apt.Sources {
		if want := "deb [signed-by=$KEY_FILE] " + aptURL + " " + Suite + " " + Component; s.Source != want {
			t.Errorf("user-data apt source %s is %q, want %q", name, s.Source, want)
		}
		if strings.TrimSpace(s.Key) != strings.TrimSpace(key) || s.KeyID != "" {
			t.Errorf("user-data apt source %s has key %q (keyid %q), want the repository's key", name, s.Key, s.KeyID)
		}
	}
	yum := u.YumRepos["vco-storage"]
	if len(u.YumRepos) != 1 || yum == nil {
		t.Fatalf("user-data has yum_repos %v, want vco-storage alone", u.YumRepos)
	}
	for k, v := range repo {
		got := yum[k]
		if b, ok := got.(bool); ok {
			got = map[bool]string{true: "1", false: "0"}[b]
		}
		if got != v {
			t.Errorf("user-data yum_repos.vco-storage.%s is %v, vco-storage.repo says %s", k, yum[k], v)
		}
	}
	if len(yum) != len(repo) {
		t.Errorf("user-data yum_repos.vco-storage has %v, vco-storage.repo %v", yum, repo)
	}
	if !slices.Equal(u.Packages, []string{Package}) {
		t.Errorf("user-data installs %v, want [%s]", u.Packages, Package)
	}
}

// TestBuiltRepository checks the files make-repo.sh rendered against the
// repository it made: VCO_REPO_DIR is its output (dist/repo), served at
// VCO_REPO_URL, and VCO_IMAGE_BUILDER_DIR holds the image-builder
// variables (dist/image-builder). make test-repo sets them.
func TestBuiltRepository(t *testing.T) {
	dir, base, ibDir := os.Getenv("VCO_REPO_DIR"), os.Getenv("VCO_REPO_URL"), os.Getenv("VCO_IMAGE_BUILDER_DIR")
	if dir == "" || base == "" || ibDir == "" {
		t.Skip("VCO_REPO_DIR, VCO_REPO_URL and VCO_IMAGE_BUILDER_DIR are not set: make test-repo runs this test on a repository it builds")
	}
	key := strings.TrimSpace(string(read(t, filepath.Join(dir, Keyring+".asc"))))
	local := func(url string) string {
		rel, ok := strings.CutPrefix(url, base)
		if !ok {
			t.Fatalf("%s is not under the repository's URL %s", url, base)
		}
		return filepath.Join(dir, filepath.FromSlash(rel))
	}

	sources := filepath.Join(dir, "vco-storage.sources")
	src := deb822(t, read(t, sources))
	if got := strings.TrimSpace(src["Signed-By"]); got != key {
		t.Errorf("vco-storage.sources: Signed-By is not the shipped key %s.asc:\n%s", Keyring, got)
	}
	apt := local(src["URIs"])
	for _, arch := range []string{"amd64", "arm64"} {
		p := filepath.Join(apt, "dists", src["Suites"], src["Components"], "binary-"+arch, "Packages")
		if !slices.Contains(strings.Split(string(read(t, p)), "\n"), "Package: "+Package) {
			t.Errorf("%s has no %s", p, Package)
		}
	}
	for _, f := range []string{"InRelease", "Release", "Release.gpg"} {
		if _, err := os.Stat(filepath.Join(apt, "dists", src["Suites"], f)); err != nil {
			t.Error(err)
		}
	}

	repoPath := filepath.Join(dir, "vco-storage.repo")
	_, repo := repoFile(t, read(t, repoPath))
	if got := strings.TrimSpace(string(read(t, local(repo["gpgkey"])))); got != key {
		t.Errorf("vco-storage.repo: gpgkey %s is not the shipped key", repo["gpgkey"])
	}
	yum := local(repo["baseurl"])
	if _, err := os.Stat(filepath.Join(yum, "repodata", "repomd.xml.asc")); err != nil {
		t.Error(err)
	}
	if names := yumPackages(t, yum); !slices.Contains(names, Package) {
		t.Errorf("the yum repository %s has %v, no %s", yum, names, Package)
	}

	checkUserDataRepository(t, readUserData(t, read(t, filepath.Join(dir, "user-data.yaml"))), src["URIs"], key, repo)
	seed := readUserData(t, read(t, "../cloud-init/user-data.yaml"))
	built := readUserData(t, read(t, filepath.Join(dir, "user-data.yaml")))
	if !reflect.DeepEqual(built.WriteFiles, seed.WriteFiles) || !reflect.DeepEqual(built.RunCmd, seed.RunCmd) {
		t.Error("the repository's user-data.yaml does not configure and start the agent as packaging/cloud-init/user-data.yaml does")
	}

	for file, want := range map[string]string{"vco-agent-deb.json": sources, "vco-agent-rpm.json": repoPath} {
		v := readVars(t, filepath.Join(ibDir, file))
		if v.ExtraRepos != want || !bytes.Equal(read(t, v.ExtraRepos), read(t, want)) {
			t.Errorf("%s: extra_repos %q, want the repository's %s", file, v.ExtraRepos, want)
		}
		if pkgs := strings.Fields(v.ExtraDebs + " " + v.ExtraRpms); !slices.Equal(pkgs, []string{Package}) {
			t.Errorf("%s installs %v, want [%s]", file, pkgs, Package)
		}
	}
}

// yumPackages lists the package names of a yum repository's primary
// metadata, found through its repomd.xml.
func yumPackages(t *testing.T, yum string) []string {
	t.Helper()
	var repomd struct {
		Data []struct {
			Type     string `xml:"type,attr"`
			Location struct {
				Href string `xml:"href,attr"`
			} `xml:"location"`
		} `xml:"data"`
	}
	if err := xml.Unmarshal(read(t, filepath.Join(yum, "repodata", "repomd.xml")), &repomd); err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(repomd.Data, func(d struct {
		Type     string `xml:"type,attr"`
		Location struct {
			Href string `xml:"href,attr"`
		} `xml:"location"`
	}) bool {
		return d.Type == "primary"
	})
	if i < 0 {
		t.Fatal("repomd.xml lists no primary metadata")
	}
	zr, err := gzip.NewReader(bytes.NewReader(read(t, filepath.Join(yum, repomd.Data[i].Location.Href))))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	var primary struct {
		Packages []struct {
			Name string `xml:"name"`
		} `xml:"package"`
	}
	if err := xml.Unmarshal(b, &primary); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range primary.Packages {
		names = append(names, p.Name)
	}
	return names
}
