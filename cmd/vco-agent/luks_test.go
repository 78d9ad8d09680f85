package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func runLuksCLI(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := luksCLI{stdin: strings.NewReader(stdin), stdout: &out, stderr: &errb}.run(args)
	return code, out.String(), errb.String()
}

var fastKDF = []string{"--kdf-time", "4", "--kdf-memory", "8192", "--kdf-threads", "1"}

func TestLuksCLIFlow(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "vol.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	pf := filepath.Join(dir, "pass")
	os.WriteFile(pf, []byte("first secret"), 0o600)

	luksFormatOnlyOnce(t, img, pf)
	luksDumpJSONDescribesTheVolume(t, img)
	luksMovePassphraseToSlot1(t, img, pf)
	luksDamagedPrimaryIsReportedAndRepaired(t, img)

	if _, err := exec.LookPath("cryptsetup"); err == nil {
		cmd := exec.Command("cryptsetup", "open", "--test-passphrase", "--key-file", "-", img)
		cmd.Stdin = strings.NewReader("second secret")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("cryptsetup on the CLI-made volume: %v %s", err, out)
		}
	}
}

// luksFormatOnlyOnce: format takes its passphrase from a file only, and a
// second format finds the first one.
func luksFormatOnlyOnce(t *testing.T, img, pf string) {
	t.Helper()
	// A passphrase is never taken from the command line.
	if code, _, errs := runLuksCLI(t, "", "format", img); code != 1 || !strings.Contains(errs, "--passphrase-file") {
		t.Fatalf("format without passphrase file: %d %s", code, errs)
	}
	args := append([]string{"format", img, "--passphrase-file", pf, "--label", "data"}, fastKDF...)
	if code, out, errs := runLuksCLI(t, "", args...); code != 0 || !strings.Contains(out, "LUKS2 volume") {
		t.Fatalf("format: %d %s %s", code, out, errs)
	}
	// A second format finds the first one.
	if code, _, errs := runLuksCLI(t, "", args...); code != 1 || !strings.Contains(errs, "LUKS signature") {
		t.Fatalf("format over LUKS: %d %s", code, errs)
	}
}

// luksDumpJSONDescribesTheVolume: dump --json gives the label, a whole
// primary header, the data size, the keyslot's KDF and the sector size.
func luksDumpJSONDescribesTheVolume(t *testing.T, img string) {
	t.Helper()
	code, out, errs := runLuksCLI(t, "", "dump", "--json", img)
	if code != 0 {
		t.Fatalf("dump: %s", errs)
	}
	var d struct {
		UUID     string   `json:"uuid"`
		Label    string   `json:"label"`
		Source   string   `json:"source"`
		Damaged  []string `json:"damaged"`
		DataSize uint64   `json:"data_size"`
		Metadata struct {
			Keyslots map[string]struct {
				KDF struct {
					Type   string `json:"type"`
					Memory int    `json:"memory"`
				} `json:"kdf"`
			} `json:"keyslots"`
			Segments map[string]struct {
				SectorSize int `json:"sector_size"`
			} `json:"segments"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal([]byte(out), &d); err != nil {
		t.Fatalf("dump --json output is not JSON: %v\n%s", err, out)
	}
	if d.Label != "data" || d.Source != "primary" || len(d.Damaged) != 0 || d.DataSize != 16<<20 ||
		d.Metadata.Keyslots["0"].KDF.Type != "argon2id" || d.Metadata.Keyslots["0"].KDF.Memory != 8192 || d.Metadata.Segments["0"].SectorSize != 4096 {
		t.Fatalf("dump: %+v", d)
	}
}

// luksMovePassphraseToSlot1: the passphrase is read from stdin exactly (a
// newline makes another one); a second passphrase is added in slot 1, and
// slot 0 is removed only on the proof of another slot, after which only
// slot 1 is left.
func luksMovePassphraseToSlot1(t *testing.T, img, pf string) {
	t.Helper()
	if code, out, _ := runLuksCLI(t, "first secret", "test-passphrase", "--passphrase-file", "-", img); code != 0 || !strings.Contains(out, "keyslot 0") {
		t.Fatalf("test-passphrase from stdin: %d %s", code, out)
	}
	if code, _, errs := runLuksCLI(t, "first secret\n", "test-passphrase", "--passphrase-file", "-", img); code != 1 || !strings.Contains(errs, "no keyslot accepts") {
		t.Fatalf("a passphrase with a newline is a different passphrase: %d %s", code, errs)
	}

	if code, out, errs := runLuksCLI(t, "second secret", append([]string{"add-key", img, "--passphrase-file", pf, "--new-passphrase-file", "-"}, fastKDF...)...); code != 0 || !strings.Contains(out, "keyslot 1") {
		t.Fatalf("add-key: %d %s %s", code, out, errs)
	}
	if code, _, errs := runLuksCLI(t, "first secret", "remove-key", img, "--key-slot", "0", "--passphrase-file", "-"); code != 1 || !strings.Contains(errs, "refusing") {
		t.Fatalf("remove-key proven only by the slot itself: %d %s", code, errs)
	}
	if code, _, errs := runLuksCLI(t, "second secret", "remove-key", img, "--key-slot", "0", "--passphrase-file", "-"); code != 0 {
		t.Fatalf("remove-key: %s", errs)
	}
	if code, _, _ := runLuksCLI(t, "first secret", "test-passphrase", "--passphrase-file", "-", img); code != 1 {
		t.Fatal("removed passphrase still works")
	}
	if code, out, _ := runLuksCLI(t, "", "dump", img); code != 0 || !strings.Contains(out, "Keyslot 1:") || strings.Contains(out, "Keyslot 0:") {
		t.Fatalf("text dump: %s", out)
	}
}

// luksDamagedPrimaryIsReportedAndRepaired: damage the primary: dump
// reports it, repair fixes it.
func luksDamagedPrimaryIsReportedAndRepaired(t *testing.T, img string) {
	t.Helper()
	f, _ := os.OpenFile(img, os.O_RDWR, 0)
	f.WriteAt([]byte("junk"), 5000)
	f.Close()
	if code, out, _ := runLuksCLI(t, "", "dump", img); code != 0 || !strings.Contains(out, "DAMAGED:    primary header") {
		t.Fatalf("dump of a damaged header: %s", out)
	}
	if code, out, errs := runLuksCLI(t, "", "repair", img); code != 0 || !strings.Contains(out, "repairing") {
		t.Fatalf("repair: %d %s %s", code, out, errs)
	}
	if code, out, _ := runLuksCLI(t, "", "dump", img); code != 0 || strings.Contains(out, "DAMAGED") {
		t.Fatalf("dump after repair: %s", out)
	}
}

func TestLuksCLIUsage(t *testing.T) {
	if code, _, _ := runLuksCLI(t, ""); code != 2 {
		t.Fatal("no subcommand")
	}
	if code, _, errs := runLuksCLI(t, "", "frobnicate", "x"); code != 2 || !strings.Contains(errs, "unknown subcommand") {
		t.Fatal(errs)
	}
	if code, _, _ := runLuksCLI(t, "", "open", "only-device"); code != 2 {
		t.Fatal("open with one argument")
	}
	if code, _, errs := runLuksCLI(t, "", "add-key", "x", "--passphrase-file", "-", "--new-passphrase-file", "-"); code != 1 || !strings.Contains(errs, "only one") {
		t.Fatal(errs)
	}
}
