package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
	"github.com/whitesky-cloud/vco-storage/fence/scsi"
	"github.com/whitesky-cloud/vco-storage/smbios"
)

// The fence subcommands run the reservation engine directly against a
// device, the way sg_persist does, with or without a running agent.

const fenceUsage = `usage: vco-agent fence <show|acquire|release|check|find|cycle> DEVICE [flags]

DEVICE is a device path (/dev/sdb, /dev/disk/by-id/...; only its major:minor
is used) or a locator: pci=00:07[,serial=S][,wwn=naa.X]. 'find' takes a
locator or nothing (list every disk).

  show     keys, reservation, holder node where known, PR capabilities
  acquire  claim the disk; refused when another node holds it (exit 1)
           unless --grant names the holder's key
  release  release the reservation and unregister this node's key
  check    exit 0 when this node's claim is intact, 1 when it is lost
  find     list disks, or the one a locator names
  cycle    acquire and release a free disk --count times; print latencies

flags:
`

type fenceOptions struct {
	json      bool
	sysfsRoot string
	devRoot   string
	uuid      string
	disk      string
	grant     string
	prefer    string
	nodes     multiFlag
	timeout   time.Duration
	verbose   bool
	count     int
}

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// fenceTarget is an opened, verified device and its SCSI transport.
type fenceTarget struct {
	disk      discovery.Disk
	transport scsi.Transport
	verify    func(context.Context) error
	close     func() error
}

// openFenceTarget finds and opens the device; tests replace it to reach a
// model target instead of SG_IO.
var openFenceTarget = func(ctx context.Context, o *fenceOptions, device string) (*fenceTarget, error) {
	f := discovery.Finder{SysfsRoot: o.sysfsRoot, DevRoot: o.devRoot}
	var (
		d   discovery.Disk
		loc discovery.Locator
		err error
	)
	if strings.HasPrefix(device, "/") {
		d, err = f.ByDevice(device)
	} else {
		if loc, err = discovery.ParseLocator(device); err == nil {
			d, err = f.Find(loc)
		}
	}
	if err != nil {
		return nil, err
	}
	opened, err := f.Open(ctx, d, loc)
	if err != nil {
		return nil, err
	}
	t := opened.SCSI
	if t == nil {
		// Not SCSI as far as sysfs knows; SG_IO will say so precisely.
		t = scsi.NewSGIO(opened.File)
	}
	return &fenceTarget{disk: d, transport: t, verify: opened.Verify, close: opened.Close}, nil
}

func runFence(args []string) int { return fenceMain(args, os.Stdout, os.Stderr) }

func fenceMain(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stderr, fenceUsage)
		return 2
	}
	sub := args[0]
	var o fenceOptions
	fs := o.flagSet(sub, stderr)
	pos, err := parseInterleaved(fs, args[1:])
	if err != nil {
		return 2
	}
	out := &fenceOutput{o: &o, stdout: stdout, stderr: stderr}
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	switch sub {
	case "find":
		if len(pos) > 1 {
			fs.Usage()
			return 2
		}
		return fenceFind(&o, pos, out)
	case "show", "acquire", "release", "check", "cycle":
	default:
		fmt.Fprintf(stderr, "vco-agent fence: unknown subcommand %q\n\n", sub)
		fs.Usage()
		return 2
	}
	if len(pos) != 1 {
		fs.Usage()
		return 2
	}
	if sub != "acquire" && o.grant != "" {
		return out.fail(fmt.Errorf("--grant only applies to acquire"))
	}
	cfg, grant, err := fenceConfig(&o)
	if err != nil {
		return out.fail(err)
	}
	t, err := openFenceTarget(ctx, &o, pos[0])
	if err != nil {
		return out.fail(err)
	}
	defer t.close()
	cfg.Verify = t.verify
	e, err := pr.New(t.disk.DevPath, t.transport, cfg)
	if err != nil {
		return out.fail(err)
	}
	return out.onEngine(ctx, sub, e, t.disk, cfg.Key, grant)
}

// flagSet is the flags of fence sub, set into o.
func (o *fenceOptions) flagSet(sub string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("fence "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, fenceUsage); fs.PrintDefaults() }
	fs.BoolVar(&o.json, "json", false, "print the result as JSON")
	fs.StringVar(&o.sysfsRoot, "sysfs-root", smbios.DefaultSysfsRoot, "sysfs mount point (node UUID and disk discovery)")
	fs.StringVar(&o.devRoot, "dev-root", "/dev", "directory holding device nodes")
	fs.StringVar(&o.uuid, "uuid", "", "this node's SMBIOS UUID (default: read from sysfs)")
	fs.StringVar(&o.disk, "disk", "", "cloud disk id the device is for (a grant must name it)")
	fs.StringVar(&o.grant, "grant", "", "takeover grant from the controller: JSON, or @FILE")
	fs.StringVar(&o.prefer, "type", "we", "reservation type: we (Write Exclusive) or ea (Exclusive Access)")
	fs.Var(&o.nodes, "node", "NAME=UUID of a node whose key may appear (repeatable), to name holders")
	fs.DurationVar(&o.timeout, "timeout", 60*time.Second, "bound on the whole operation")
	fs.BoolVar(&o.verbose, "v", false, "log each step to stderr")
	fs.IntVar(&o.count, "count", 20, "cycle: number of acquire/release cycles")
	return fs
}

// onEngine runs subcommand sub with the engine e on disk, for this node's
// key.
func (f *fenceOutput) onEngine(ctx context.Context, sub string, e *pr.Engine, disk discovery.Disk, key fence.Key, grant *fence.Grant) int {
	switch sub {
	case "show":
		st, err := e.Status(ctx)
		if err != nil {
			return f.fail(err)
		}
		return f.show(disk, st)
	case "acquire":
		c, err := e.Acquire(ctx, grant)
		if err != nil {
			return f.fail(err)
		}
		return f.ok(claimMessage(disk.DevPath, c), map[string]any{"claim": c})
	case "release":
		if err := e.Release(ctx); err != nil {
			return f.fail(err)
		}
		return f.ok(fmt.Sprintf("%s released by key %s", disk.DevPath, key), nil)
	case "check":
		if err := e.Check(ctx); err != nil {
			return f.fail(err)
		}
		return f.ok(fmt.Sprintf("%s: claim of key %s is intact", disk.DevPath, key), nil)
	case "cycle":
		st, err := pr.Cycle(ctx, e, f.o.count)
		if err != nil {
			return f.fail(err)
		}
		return f.ok(fmt.Sprintf("%s: %d cycles, median acquire %v, median release %v", disk.DevPath, st.Cycles,
			pr.Median(st.Acquire), pr.Median(st.Release)), map[string]any{"stats": st})
	}
	return 2
}

// claimMessage says what an acquisition of dev did.
func claimMessage(dev string, c fence.Acquired) string {
	msg := fmt.Sprintf("%s claimed with key %s (%s)", dev, c.Key, c.Type)
	if c.Already {
		msg = fmt.Sprintf("%s already claimed by this node with key %s (%s)", dev, c.Key, c.Type)
	}
	if len(c.Preempted) > 0 {
		how := "PREEMPT AND ABORT"
		if !c.PreemptAndAbort {
			how = "PREEMPT (the target rejects PREEMPT AND ABORT)"
		}
		msg += fmt.Sprintf("; took over from key(s) %v with %s", c.Preempted, how)
	}
	return msg
}

func fenceConfig(o *fenceOptions) (pr.Config, *fence.Grant, error) {
	var cfg pr.Config
	uuid := o.uuid
	if uuid == "" {
		info, err := smbios.Read(o.sysfsRoot)
		if err != nil {
			return cfg, nil, fmt.Errorf("this node's identity: %w (pass --uuid to give it)", err)
		}
		uuid = info.UUID
	}
	key, err := fence.KeyFromUUID(uuid)
	if err != nil {
		return cfg, nil, err
	}
	cfg.Key, cfg.Node, cfg.Disk = key, uuid, o.disk
	switch strings.ToLower(o.prefer) {
	case "we", "write-exclusive", "1":
		cfg.Prefer = fence.WriteExclusive
	case "ea", "exclusive-access", "3":
		cfg.Prefer = fence.ExclusiveAccess
	default:
		return cfg, nil, fmt.Errorf("--type %q: want we or ea", o.prefer)
	}
	nodes := map[string]string{}
	for _, n := range o.nodes {
		name, u, ok := strings.Cut(n, "=")
		if !ok || name == "" {
			return cfg, nil, fmt.Errorf("--node %q: want NAME=UUID", n)
		}
		nodes[name] = u
	}
	dir, err := fence.NewDirectory(nodes)
	if err != nil {
		return cfg, nil, fmt.Errorf("--node: %w", err)
	}
	cfg.Resolver = dir
	cfg.Timeout = 20 * time.Second
	if o.verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	var grant *fence.Grant
	if o.grant != "" {
		text := o.grant
		if path, ok := strings.CutPrefix(text, "@"); ok {
			b, err := os.ReadFile(path)
			if err != nil {
				return cfg, nil, fmt.Errorf("reading the grant: %w", err)
			}
			text = string(b)
		}
		if grant, err = fence.ParseGrant(text); err != nil {
			return cfg, nil, err
		}
	}
	return cfg, grant, nil
}

func fenceFind(o *fenceOptions, pos []string, out *fenceOutput) int {
	f := discovery.Finder{SysfsRoot: o.sysfsRoot, DevRoot: o.devRoot}
	var disks []discovery.Disk
	if len(pos) == 0 {
		all, err := f.List()
		if err != nil {
			return out.fail(err)
		}
		disks = all
	} else {
		loc, err := discovery.ParseLocator(pos[0])
		if err != nil {
			return out.fail(err)
		}
		d, err := f.Find(loc)
		if err != nil {
			return out.fail(err)
		}
		disks = []discovery.Disk{d}
	}
	if o.json {
		return out.writeJSON(map[string]any{"ok": true, "disks": disks}, 0)
	}
	for _, d := range disks {
		pci := "-"
		if d.PCI != nil {
			pci = d.PCI.String()
		}
		wwn := "-"
		if len(d.WWNs) > 0 {
			wwn = d.WWNs[0]
		}
		serial := d.Serial
		if serial == "" {
			serial = "-"
		}
		fmt.Fprintf(out.stdout, "%-14s %-10s %-13s %-24s %s\n", d.DevPath, d.Kind, pci, serial, wwn)
	}
	return 0
}

type fenceOutput struct {
	o              *fenceOptions
	stdout, stderr io.Writer
}

func (f *fenceOutput) writeJSON(v any, code int) int {
	enc := json.NewEncoder(f.stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		fmt.Fprintln(f.stderr, "vco-agent fence:", err)
		return 1
	}
	return code
}

func (f *fenceOutput) ok(msg string, extra map[string]any) int {
	if f.o.json {
		v := map[string]any{"ok": true, "message": msg}
		for k, x := range extra {
			v[k] = x
		}
		return f.writeJSON(v, 0)
	}
	fmt.Fprintln(f.stdout, msg)
	return 0
}

func (f *fenceOutput) fail(err error) int {
	var (
		he *fence.HeldError
		le *fence.LostError
	)
	if f.o.json {
		v := map[string]any{"ok": false, "error": err.Error()}
		switch {
		case errors.As(err, &he):
			v["refused"] = true
			v["holder"] = he.Holder
			v["holder_node"] = he.HolderNode
		case errors.As(err, &le):
			v["lost"] = true
			if le.Holder != 0 {
				v["holder"] = le.Holder
				v["holder_node"] = le.HolderNode
			}
		case errors.Is(err, fence.ErrNotSupported):
			v["not_supported"] = true
		}
		return f.writeJSON(v, 1)
	}
	fmt.Fprintln(f.stderr, "vco-agent fence:", err)
	return 1
}

func (f *fenceOutput) show(d discovery.Disk, st pr.Status) int {
	if f.o.json {
		return f.writeJSON(map[string]any{"ok": true, "disk": d, "status": st}, 0)
	}
	w := f.stdout
	fmt.Fprintf(w, "device:       %s (%s)\n", d.DevPath, diskNames(d))
	fmt.Fprintf(w, "this node:    key %s\n", st.OwnKey)
	if !showSupport(w, st) {
		return 0
	}
	fmt.Fprintf(w, "generation:   %d\n", st.Generation)
	showKeys(w, st.Keys)
	showReservation(w, st.Reservation)
	return 0
}

// diskNames is the disk's kind and the names it is found by.
func diskNames(d discovery.Disk) string {
	id := string(d.Kind)
	if d.PCI != nil {
		id += ", pci " + d.PCI.String()
	}
	if d.Serial != "" {
		id += ", serial " + d.Serial
	}
	if len(d.WWNs) > 0 {
		id += ", wwn " + d.WWNs[0]
	}
	return id
}

// showSupport prints whether the disk supports reservations and the
// types it reports; false when there is nothing more to show.
func showSupport(w io.Writer, st pr.Status) bool {
	if st.Support.Method != fence.MethodPR {
		fmt.Fprintf(w, "reservations: not supported: %s\n", st.Support.Reason)
		if len(st.Support.Types) == 0 {
			return false
		}
	} else {
		fmt.Fprintf(w, "reservations: supported; acquire uses %s\n", st.Support.Preferred)
	}
	if st.Capabilities != nil {
		names := make([]string, len(st.Support.Types))
		for i, t := range st.Support.Types {
			names[i] = t.String()
		}
		types := "not reported"
		if len(names) > 0 {
			types = strings.Join(names, ", ")
		}
		fmt.Fprintf(w, "capabilities: types: %s; persist through power loss: %v\n", types, st.Capabilities.PTPLCapable)
	}
	return true
}

// showKeys prints the registered keys, a line each.
func showKeys(w io.Writer, keys []pr.KeyInfo) {
	if len(keys) == 0 {
		fmt.Fprintln(w, "keys:         none registered")
	}
	for i, k := range keys {
		label := "keys:        "
		if i > 0 {
			label = "             "
		}
		line := fmt.Sprintf("%s %s", label, k.Key)
		if k.Node != "" {
			line += " node " + k.Node
		} else {
			line += " node unknown"
		}
		if k.Initiator != "" {
			line += " initiator " + k.Initiator
		}
		if k.Holder {
			line += " [holder]"
		}
		fmt.Fprintln(w, line)
	}
}

// showReservation prints the reservation and its holder.
func showReservation(w io.Writer, r *pr.ReservationInfo) {
	if r == nil {
		fmt.Fprintln(w, "reservation:  none")
		return
	}
	holder := "all registrants"
	if r.Key != 0 {
		holder = "key " + r.Key.String()
		if r.Node != "" {
			holder += " (node " + r.Node + ")"
		} else {
			holder += " (node unknown)"
		}
	}
	fmt.Fprintf(w, "reservation:  %s, held by %s\n", r.Type, holder)
}
