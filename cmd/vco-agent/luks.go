package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/dmcrypt"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
	"github.com/whitesky-cloud/vco-storage/internal/safety/blank"
)

// luksCLI is the operator's tool for LUKS2 volumes on a device or image
// file. Passphrases come from a file or stdin, never from the command line
// where ps and shell history would show them.
type luksCLI struct {
	stdin          io.Reader
	stdout, stderr io.Writer
}

func runLuks(args []string) int {
	return luksCLI{stdin: os.Stdin, stdout: os.Stdout, stderr: os.Stderr}.run(args)
}

const luksUsage = `usage: vco-agent luks <subcommand> [flags] <args>

  format          <device>         write a new LUKS2 header (refuses a device that holds data)
  dump            <device>         show the header (--json for machine use); no device-mapper needed
  test-passphrase <device>         check a passphrase; no device-mapper needed
  open            <device> <name>  unlock and map as /dev/mapper/<name>
  close           <name>           remove the mapping
  status          <name>           the mapping's state and table (key hidden), as JSON
  resize          <name>           grow the mapping to its grown backing device, online
  add-key         <device>         add a keyslot for a new passphrase
  remove-key      <device>         remove a keyslot, proving another one works
  repair          <device>         rewrite a damaged or stale header copy from the good one

Passphrases are read from --passphrase-file (and --new-passphrase-file),
where "-" means stdin, byte for byte like cryptsetup's --key-file.
Run 'vco-agent luks <subcommand> --help' for its flags.`

func (c luksCLI) run(args []string) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprintln(c.stderr, luksUsage)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	sub, rest := args[0], args[1:]
	fs := flag.NewFlagSet("luks "+sub, flag.ContinueOnError)
	fs.SetOutput(c.stderr)
	var f luksFlags
	npos := f.register(fs, sub)
	if npos == 0 {
		fmt.Fprintf(c.stderr, "vco-agent luks: unknown subcommand %q\n\n%s\n", sub, luksUsage)
		return 2
	}
	pos, err := parseInterleaved(fs, rest)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if len(pos) != npos {
		fmt.Fprintf(c.stderr, "vco-agent luks %s: expected %d argument(s), got %d\n", sub, npos, len(pos))
		fs.Usage()
		return 2
	}
	if err := c.do(sub, pos, &f); err != nil {
		fmt.Fprintf(c.stderr, "vco-agent luks %s: %v\n", sub, err)
		return 1
	}
	return 0
}

// luksFlags are the flags of the luks subcommands; each subcommand
// registers its own.
type luksFlags struct {
	passFile, newPassFile    string
	jsonOut, force, readOnly bool
	discards                 bool
	sector, slot             int
	kdf                      luks2.KDFParams
	label                    string
	timeout                  time.Duration
}

// register registers the flags of subcommand sub with fs and returns how
// many arguments it takes, or 0 for an unknown subcommand.
func (f *luksFlags) register(fs *flag.FlagSet, sub string) int {
	fs.StringVar(&f.passFile, "passphrase-file", "", "file holding the passphrase (\"-\" for stdin)")
	switch sub {
	case "format":
		f.kdfFlags(fs)
		fs.IntVar(&f.sector, "sector-size", 4096, "encryption sector size, 512 or 4096")
		fs.StringVar(&f.label, "label", "", "header label")
		fs.BoolVar(&f.discards, "allow-discards", false, "store the allow-discards flag")
		fs.BoolVar(&f.force, "force", false, "format even over existing data (destroys it; tests and checked devices only)")
	case "dump":
		fs.BoolVar(&f.jsonOut, "json", false, "print JSON")
	case "test-passphrase":
		fs.IntVar(&f.slot, "key-slot", -1, "only try this keyslot")
	case "open":
		fs.BoolVar(&f.readOnly, "readonly", false, "map read-only")
		fs.BoolVar(&f.discards, "allow-discards", false, "pass discards through")
		return 2
	case "close":
		fs.DurationVar(&f.timeout, "timeout", crypt.CloseTimeout, "how long to retry while the mapping is busy")
	case "resize", "status", "repair":
	case "add-key":
		f.kdfFlags(fs)
		fs.StringVar(&f.newPassFile, "new-passphrase-file", "", "file holding the new passphrase (\"-\" for stdin)")
	case "remove-key":
		fs.IntVar(&f.slot, "key-slot", -1, "keyslot to remove")
	default:
		return 0
	}
	return 1
}

func (f *luksFlags) kdfFlags(fs *flag.FlagSet) {
	fs.StringVar(&f.kdf.Type, "pbkdf", luks2.DefaultKDF.Type, "key derivation: argon2id, argon2i or pbkdf2")
	fs.IntVar(&f.kdf.Time, "kdf-time", luks2.DefaultKDF.Time, "argon2 passes")
	fs.IntVar(&f.kdf.MemoryKiB, "kdf-memory", luks2.DefaultKDF.MemoryKiB, "argon2 memory in KiB")
	fs.IntVar(&f.kdf.Threads, "kdf-threads", luks2.DefaultKDF.Threads, "argon2 parallelism")
	fs.IntVar(&f.kdf.Iterations, "pbkdf-iterations", 0, "pbkdf2 iterations (with --pbkdf pbkdf2)")
}

// do runs subcommand sub on its arguments pos.
func (c luksCLI) do(sub string, pos []string, f *luksFlags) error {
	switch sub {
	case "format":
		return c.format(pos[0], f.passFile, luks2.FormatOptions{KDF: f.kdf, SectorSize: f.sector, Label: f.label, AllowDiscards: f.discards, Force: f.force})
	case "dump":
		return c.dump(pos[0], f.jsonOut)
	case "test-passphrase":
		return c.testPassphrase(pos[0], f.passFile, f.slot)
	case "open":
		return c.open(pos[0], pos[1], f.passFile, crypt.OpenOptions{ReadOnly: f.readOnly, AllowDiscards: f.discards})
	case "close":
		return crypt.Close(pos[0], f.timeout)
	case "resize":
		n, err := crypt.Resize(pos[0])
		if err == nil {
			fmt.Fprintf(c.stdout, "%s: %d bytes\n", pos[0], n)
		}
		return err
	case "status":
		st, err := dmcrypt.GetStatus(pos[0])
		if err != nil {
			return err
		}
		enc := json.NewEncoder(c.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	case "add-key":
		return c.addKey(pos[0], f.passFile, f.newPassFile, f.kdf)
	case "remove-key":
		return c.removeKey(pos[0], f.passFile, f.slot)
	case "repair":
		return c.repair(pos[0])
	}
	return nil
}

// readPassphrase reads a passphrase exactly as stored (no newline is
// stripped, as with cryptsetup --key-file).
func (c luksCLI) readPassphrase(path, what string) ([]byte, error) {
	if path == "" {
		return nil, fmt.Errorf("no %s given: use --%s-file FILE or --%s-file - for stdin", what, what, what)
	}
	var b []byte
	var err error
	if path == "-" {
		b, err = io.ReadAll(io.LimitReader(c.stdin, 8192+1))
	} else {
		b, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", what, err)
	}
	if len(b) == 0 || len(b) > 8192 {
		return nil, fmt.Errorf("%s must be 1 to 8192 bytes, got %d", what, len(b))
	}
	return b, nil
}

func (c luksCLI) format(dev, passFile string, o luks2.FormatOptions) error {
	pass, err := c.readPassphrase(passFile, "passphrase")
	if err != nil {
		return err
	}
	defer clear(pass)
	o.Passphrase = pass
	if !o.Force {
		// The agent's own blank proof (P5), which reads more of the
		// device than luks2's signature check.
		if _, err := blank.Prove(context.Background(), dev); err != nil {
			return fmt.Errorf("format %s: %w; refusing to format over existing data (P5)", dev, err)
		}
	}
	v, err := luks2.Format(dev, o)
	if err != nil {
		return err
	}
	defer v.Close()
	fmt.Fprintf(c.stdout, "%s: LUKS2 volume %s, data at %d, sector size %d\n", dev, v.Header.UUID, v.DataOffset(), v.SectorSize())
	return nil
}

// dumpJSON is the machine-readable dump: the binary header fields, which
// copy was used and what is wrong with the other, and the metadata as
// stored.
type dumpJSON struct {
	Device    string          `json:"device"`
	UUID      string          `json:"uuid"`
	Label     string          `json:"label"`
	Subsystem string          `json:"subsystem"`
	Seqid     uint64          `json:"seqid"`
	HdrSize   uint64          `json:"hdr_size"`
	Source    string          `json:"source"`
	Damaged   []string        `json:"damaged"`
	DataSize  uint64          `json:"data_size"`
	Metadata  *luks2.Metadata `json:"metadata"`
}

func (c luksCLI) dump(dev string, asJSON bool) error {
	v, err := luks2.Open(dev, false)
	if err != nil {
		return err
	}
	defer v.Close()
	h := v.Header
	size, err := v.DataSize()
	if err != nil {
		return err
	}
	if asJSON {
		d := dumpJSON{Device: dev, UUID: h.UUID, Label: h.Label, Subsystem: h.Subsystem, Seqid: h.Seqid, HdrSize: h.HdrSize,
			Source: h.Source, Damaged: h.Damaged, DataSize: size, Metadata: h.Meta}
		if d.Damaged == nil {
			d.Damaged = []string{}
		}
		enc := json.NewEncoder(c.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(d)
	}
	w := c.stdout
	fmt.Fprintf(w, "Device:     %s\nUUID:       %s\nLabel:      %s\nSubsystem:  %s\nSeqid:      %d\nHeader:     %d bytes, read from the %s copy\n",
		dev, h.UUID, h.Label, h.Subsystem, h.Seqid, h.HdrSize, h.Source)
	for _, d := range h.Damaged {
		fmt.Fprintf(w, "DAMAGED:    %s (run 'vco-agent luks repair %s')\n", d, dev)
	}
	fmt.Fprintf(w, "Data:       %s, offset %d, %d bytes, sector %d\n", v.Cipher(), v.DataOffset(), size, v.SectorSize())
	if f := v.Flags(); len(f) > 0 {
		fmt.Fprintf(w, "Flags:      %s\n", strings.Join(f, " "))
	}
	var ids []string
	for id := range h.Meta.Keyslots {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		k := h.Meta.Keyslots[id]
		cost := fmt.Sprintf("time %d, memory %d KiB, threads %d", k.KDF.Time, k.KDF.Memory, k.KDF.CPUs)
		if k.KDF.Type == "pbkdf2" {
			cost = fmt.Sprintf("%s, %d iterations", k.KDF.Hash, k.KDF.Iterations)
		}
		fmt.Fprintf(w, "Keyslot %s:  %d-bit key, %s (%s), area %d+%d\n", id, k.KeySize*8, k.KDF.Type, cost, k.Area.Offset, k.Area.Size)
	}
	toks := v.Tokens()
	var tids []int
	for id := range toks {
		tids = append(tids, id)
	}
	sort.Ints(tids)
	for _, id := range tids {
		var t struct {
			Type     string   `json:"type"`
			Keyslots []string `json:"keyslots"`
		}
		_ = json.Unmarshal(toks[id], &t)
		fmt.Fprintf(w, "Token %d:    %s, keyslots %s\n", id, t.Type, strings.Join(t.Keyslots, ","))
	}
	return nil
}

func (c luksCLI) testPassphrase(dev, passFile string, slot int) error {
	pass, err := c.readPassphrase(passFile, "passphrase")
	if err != nil {
		return err
	}
	defer clear(pass)
	v, err := luks2.Open(dev, false)
	if err != nil {
		return err
	}
	defer v.Close()
	var key []byte
	if slot >= 0 {
		key, err = v.UnlockSlot(slot, pass)
	} else {
		key, slot, err = v.Unlock(pass)
	}
	if err != nil {
		return err
	}
	clear(key)
	fmt.Fprintf(c.stdout, "%s: keyslot %d accepts the passphrase\n", dev, slot)
	return nil
}

func (c luksCLI) open(dev, name, passFile string, o crypt.OpenOptions) error {
	pass, err := c.readPassphrase(passFile, "passphrase")
	if err != nil {
		return err
	}
	defer clear(pass)
	op, err := crypt.Unlock(context.Background(), dev, name, pass, o)
	if err != nil {
		return err
	}
	if len(op.HeaderDamage) > 0 {
		fmt.Fprintf(c.stderr, "vco-agent luks open: %s: the LUKS2 header is damaged (%s); opened from the %s copy; 'vco-agent luks repair %s' rewrites both copies\n",
			dev, strings.Join(op.HeaderDamage, "; "), op.Source, dev)
	}
	if op.Reader != crypt.ReaderLuksGo {
		fmt.Fprintf(c.stderr, "vco-agent luks open: %s: unlocked by %s, not luks.go: %s\n", dev, op.Reader, op.Why)
	}
	fmt.Fprintln(c.stdout, op.Path)
	return nil
}

func (c luksCLI) addKey(dev, passFile, newPassFile string, kdf luks2.KDFParams) error {
	if passFile == "-" && newPassFile == "-" {
		return errors.New("only one of --passphrase-file and --new-passphrase-file can be stdin")
	}
	pass, err := c.readPassphrase(passFile, "passphrase")
	if err != nil {
		return err
	}
	defer clear(pass)
	newPass, err := c.readPassphrase(newPassFile, "new-passphrase")
	if err != nil {
		return err
	}
	defer clear(newPass)
	v, err := luks2.Open(dev, true)
	if err != nil {
		return err
	}
	defer v.Close()
	n, err := v.AddKeyslot(pass, newPass, kdf)
	if err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "%s: added keyslot %d\n", dev, n)
	return nil
}

func (c luksCLI) removeKey(dev, passFile string, slot int) error {
	if slot < 0 {
		return errors.New("--key-slot is required")
	}
	pass, err := c.readPassphrase(passFile, "passphrase")
	if err != nil {
		return err
	}
	defer clear(pass)
	v, err := luks2.Open(dev, true)
	if err != nil {
		return err
	}
	defer v.Close()
	if err := v.RemoveKeyslot(slot, pass); err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "%s: removed keyslot %d\n", dev, slot)
	return nil
}

func (c luksCLI) repair(dev string) error {
	v, err := luks2.Open(dev, true)
	if err != nil {
		return err
	}
	defer v.Close()
	if len(v.Header.Damaged) == 0 {
		fmt.Fprintf(c.stdout, "%s: both header copies are intact\n", dev)
		return nil
	}
	for _, d := range v.Header.Damaged {
		fmt.Fprintf(c.stdout, "%s: repairing: %s\n", dev, d)
	}
	return v.Repair()
}
