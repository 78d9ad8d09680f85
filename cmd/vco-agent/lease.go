package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/lease"
	"github.com/whitesky-cloud/vco-storage/fence/uevent"
	"github.com/whitesky-cloud/vco-storage/smbios"
)

// The lease subcommands work on the on-disk lease of a disk without
// reservations, directly, with or without a running agent.

const leaseUsage = `usage: vco-agent lease <show|format|acquire|release|check|clear> DEVICE [flags]

DEVICE is a block device path (/dev/vdb, /dev/disk/by-id/...).

  show     the lease area: owner, every host slot, timing
  format   write the lease area on a blank disk (refused on any data)
  acquire  claim the disk and hold it, renewing, until interrupted
           (SIGINT/SIGTERM) or --hold-for ends, then release it; refused
           (exit 1) while another node holds it, unless --grant names it;
           exit 3 when the claim is lost while held. A disk a refusal
           left read-only is made writable for the claim (and read-only
           again if the claim fails), unless this node mounts, maps or
           has staged it
  release  mark this node's slot released (refused on a read-only disk)
  check    exit 0 when this node owns the lease, 1 otherwise
  clear    with --yes: take the lease (refused while another node holds
           it), release it and zero the lease area, for good; refused
           while this node mounts, maps or has staged the disk. The
           volume's data past the area (byte 1048576) is not touched.
  watch    (no DEVICE) refuse every disk held by another node's lease,
           as the agent does: read-only at the block layer; the disks
           already attached first, then each that appears, every one
           again after lost uevents and every --rescan; one line per
           decision (again only when it changes), until interrupted or
           --hold-for ends

flags:
`

type leaseOptions struct {
	json                              bool
	sysfsRoot, uuid, disk, grant      string
	nodes                             multiFlag
	timeout, holdFor, rescan          time.Duration
	ioTimeout, renew, failBound, wdog time.Duration
	verbose                           bool
	yes                               bool
	stateDir                          string
	name                              string
	interrupt                         <-chan os.Signal
	ready                             func()
	// match narrows watch to some devices (tests: their own loop device,
	// never a neighbour's).
	match          func(uevent.Event) bool
	resolver       fence.Resolver
	grantParsed    *fence.Grant
	key            fence.Key
	timing         lease.Timing
	stdout, stderr io.Writer
}

func runLease(args []string) int {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	return leaseMain(args, os.Stdout, os.Stderr, sig)
}

func leaseMain(args []string, stdout, stderr io.Writer, interrupt <-chan os.Signal) int {
	return leaseMainWith(args, stdout, stderr, interrupt, leaseHooks{})
}

// leaseHooks let tests see when acquire holds the disk or watch listens,
// and keep watch to their own devices.
type leaseHooks struct {
	ready func()
	match func(uevent.Event) bool
}

func leaseMainWith(args []string, stdout, stderr io.Writer, interrupt <-chan os.Signal, h leaseHooks) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stderr, leaseUsage)
		return 2
	}
	sub := args[0]
	o := leaseOptions{interrupt: interrupt, ready: h.ready, match: h.match, stdout: stdout, stderr: stderr}
	fs := o.flagSet(sub)
	pos, err := parseInterleaved(fs, args[1:])
	if err != nil {
		return 2
	}
	if !slices.Contains(leaseSubcommands, sub) {
		fmt.Fprintf(stderr, "vco-agent lease: unknown subcommand %q\n\n", sub)
		fs.Usage()
		return 2
	}
	if sub == "watch" {
		if len(pos) != 0 {
			fs.Usage()
			return 2
		}
		if err := o.setup(); err != nil {
			return o.fail(err)
		}
		return o.watch()
	}
	if len(pos) != 1 {
		fs.Usage()
		return 2
	}
	if err := o.flagsApply(sub); err != nil {
		return o.fail(err)
	}
	if err := o.setup(); err != nil {
		return o.fail(err)
	}
	open := lease.OpenDevice
	if sub == "show" || sub == "check" {
		open = lease.OpenDeviceReadOnly
	}
	dev, err := open(pos[0])
	if err != nil {
		return o.fail(err)
	}
	defer dev.Close()
	return o.onDevice(context.Background(), sub, dev, pos[0])
}

// leaseSubcommands are lease's subcommands.
var leaseSubcommands = []string{"show", "format", "acquire", "release", "check", "watch", "clear"}

// flagSet is the flags of lease sub, set into o.
func (o *leaseOptions) flagSet(sub string) *flag.FlagSet {
	def := lease.DefaultTiming()
	fs := flag.NewFlagSet("lease "+sub, flag.ContinueOnError)
	fs.SetOutput(o.stderr)
	fs.Usage = func() { fmt.Fprint(o.stderr, leaseUsage); fs.PrintDefaults() }
	fs.BoolVar(&o.json, "json", false, "print the result as JSON")
	fs.StringVar(&o.sysfsRoot, "sysfs-root", smbios.DefaultSysfsRoot, "sysfs mount point (node UUID)")
	fs.StringVar(&o.uuid, "uuid", "", "this node's SMBIOS UUID (default: read from sysfs)")
	fs.StringVar(&o.name, "name", "", "this node's name, written into its slot (default: host name)")
	fs.StringVar(&o.disk, "disk", "", "cloud disk id the device is for (a grant must name it)")
	fs.StringVar(&o.grant, "grant", "", "takeover grant from the controller: JSON, or @FILE")
	fs.Var(&o.nodes, "node", "NAME=UUID of a node whose key may appear (repeatable), to name holders")
	fs.DurationVar(&o.timeout, "timeout", 0, "bound on acquiring (default: the holder's expiry bound plus a minute)")
	fs.DurationVar(&o.holdFor, "hold-for", 0, "acquire: release after this long; watch: stop after this long (default: until interrupted)")
	fs.DurationVar(&o.rescan, "rescan", uevent.DefaultRescan, "watch: classify every attached disk again this often")
	fs.DurationVar(&o.ioTimeout, "io-timeout", def.IOTimeout, "lease timing: bound on one lease I/O (d)")
	fs.DurationVar(&o.renew, "renew", def.Renew, "lease timing: renewal interval (R)")
	fs.DurationVar(&o.failBound, "fail", def.Fail, "lease timing: self-fence after no renewal for this long (F)")
	fs.DurationVar(&o.wdog, "watchdog", def.Watchdog, "lease timing: host watchdog reset time (W)")
	fs.BoolVar(&o.verbose, "v", false, "log each step to stderr")
	fs.BoolVar(&o.yes, "yes", false, "clear: do it")
	fs.StringVar(&o.stateDir, "state-dir", "/var/lib/vco-agent", "acquire, clear: the agent's state directory, whose claim records name the disks staged here")
	return fs
}

// flagsApply refuses the flags given to a subcommand they do not apply to.
func (o *leaseOptions) flagsApply(sub string) error {
	if sub != "acquire" && sub != "clear" && o.grant != "" {
		return errors.New("--grant only applies to acquire and clear")
	}
	if sub != "acquire" && o.holdFor != 0 {
		return errors.New("--hold-for only applies to acquire and watch")
	}
	return nil
}

// onDevice runs subcommand sub on the opened device dev (at path).
func (o *leaseOptions) onDevice(ctx context.Context, sub string, dev *lease.Device, path string) int {
	switch sub {
	case "show":
		st, _, err := lease.ReadStatus(ctx, dev, o.key, o.timing.IOTimeout*4)
		if err != nil {
			return o.fail(err)
		}
		return o.show(st)
	case "format":
		return o.format(ctx, dev)
	case "check":
		return o.check(ctx, dev)
	case "clear":
		return o.clear(ctx, dev, path)
	}
	e, err := lease.New(dev, o.engineConfig(nil))
	if err != nil {
		return o.fail(err)
	}
	if sub == "release" {
		// The release guard of the command: the agent's fence of a disk
		// this node uses is never given up by hand.
		if err := o.notInUse(path); err != nil {
			return o.fail(fmt.Errorf("%w; not released", err))
		}
		if ro, _ := readOnlyFlag(dev); ro {
			return o.fail(fmt.Errorf("%s is read-only (%s): release writes this node's slot and does not clear the flag, which may be what stops this node's I/O to the disk; not released", dev.Name(), readOnlyWho))
		}
		if err := e.Release(ctx); err != nil {
			return o.fail(err)
		}
		return o.ok(fmt.Sprintf("%s: lease of key %s released", dev.Name(), o.key), nil)
	}
	return o.acquire(ctx, dev, path)
}

func (o *leaseOptions) format(ctx context.Context, dev *lease.Device) int {
	wrote, err := lease.Format(ctx, dev, lease.FormatOptions{Key: o.key, Timeout: o.timing.IOTimeout, Blkid: true, Logger: o.logger()})
	if err != nil {
		return o.fail(err)
	}
	if !wrote {
		return o.ok(fmt.Sprintf("%s already has a lease area; nothing written", dev.Name()), map[string]any{"formatted": false})
	}
	return o.ok(fmt.Sprintf("%s: lease area written; the volume's data starts at byte %d", dev.Name(), lease.DataOffset), map[string]any{"formatted": true, "data_offset": lease.DataOffset})
}

func (o *leaseOptions) check(ctx context.Context, dev *lease.Device) int {
	owner, err := lease.Inspect(ctx, dev.Name(), o.timing.IOTimeout*4)
	if err != nil {
		return o.fail(err)
	}
	if owner == nil {
		return o.fail(fmt.Errorf("%s: nobody holds the lease; this node (key %s) does not", dev.Name(), o.key))
	}
	if owner.Key != o.key {
		return o.fail(&fence.HeldError{Device: dev.Name(), Holder: owner.Key, HolderNode: o.nodeName(owner)})
	}
	return o.ok(fmt.Sprintf("%s: this node (key %s) owns the lease at epoch %d", dev.Name(), o.key, owner.Epoch), nil)
}

func (o *leaseOptions) setup() error {
	uuid := o.uuid
	if uuid == "" {
		info, err := smbios.Read(o.sysfsRoot)
		if err != nil {
			return fmt.Errorf("this node's identity: %w (pass --uuid to give it)", err)
		}
		uuid = info.UUID
	}
	o.uuid = uuid
	key, err := fence.KeyFromUUID(uuid)
	if err != nil {
		return err
	}
	o.key = key
	if o.name == "" {
		o.name, _ = os.Hostname()
	}
	nodes := map[string]string{}
	for _, n := range o.nodes {
		name, u, ok := strings.Cut(n, "=")
		if !ok || name == "" {
			return fmt.Errorf("--node %q: want NAME=UUID", n)
		}
		nodes[name] = u
	}
	dir, err := fence.NewDirectory(nodes)
	if err != nil {
		return fmt.Errorf("--node: %w", err)
	}
	o.resolver = dir
	o.timing = lease.Timing{IOTimeout: o.ioTimeout, Renew: o.renew, Fail: o.failBound, Watchdog: o.wdog}
	if o.grant != "" {
		text := o.grant
		if path, ok := strings.CutPrefix(text, "@"); ok {
			b, err := os.ReadFile(path)
			if err != nil {
				return fmt.Errorf("reading the grant: %w", err)
			}
			text = string(b)
		}
		if o.grantParsed, err = fence.ParseGrant(text); err != nil {
			return err
		}
	}
	return nil
}

func (o *leaseOptions) logger() *slog.Logger {
	if !o.verbose {
		return nil
	}
	return slog.New(slog.NewTextHandler(o.stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func (o *leaseOptions) engineConfig(onLost func(*fence.LostError) bool) lease.Config {
	return lease.Config{Key: o.key, Node: o.uuid, NodeName: o.name, Disk: o.disk, Resolver: o.resolver,
		Timing: o.timing, OnLost: onLost, Logger: o.logger()}
}

func (o *leaseOptions) nodeName(s *lease.Slot) string {
	if n, ok := o.resolver.NodeForKey(s.Key); ok {
		return n
	}
	return s.Node
}

func (o *leaseOptions) acquire(ctx context.Context, dev *lease.Device, path string) int {
	lost := make(chan *fence.LostError, 1)
	// The command itself writes nothing but the lease: on a loss there
	// is no other I/O of its to stop, so the slot may be marked fenced.
	e, err := lease.New(dev, o.engineConfig(func(l *fence.LostError) bool { lost <- l; return true }))
	if err != nil {
		return o.fail(err)
	}
	timeout := o.timeout
	if timeout <= 0 {
		// The holder's bound is not known before reading its slot; the
		// longest sane one is covered with the default timing's.
		timeout = max(o.timing.Expiry(), lease.DefaultTiming().Expiry()) + o.timing.Settle() + time.Minute
	}
	// The command's acquire ends in a release: on a disk this node uses
	// it would take over the agent's own claim and give it up.
	if err := o.notInUse(path); err != nil {
		return o.fail(fmt.Errorf("%w; not acquired", err))
	}
	restore, err := o.writableForLease(dev, path)
	if err != nil {
		return o.fail(err)
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	c, err := e.Acquire(actx, o.grantParsed)
	cancel()
	if err != nil {
		restore()
		return o.fail(err)
	}
	msg := fmt.Sprintf("%s claimed with key %s; holding (renewing every %s)", dev.Name(), c.Key, o.timing.Renew)
	if c.Already {
		msg = fmt.Sprintf("%s: this node's lease (key %s) resumed; holding", dev.Name(), c.Key)
	}
	if len(c.Preempted) > 0 {
		msg += fmt.Sprintf("; took over from key(s) %v", c.Preempted)
	}
	if code := o.ok(msg, map[string]any{"claim": c}); code != 0 {
		return code
	}
	if o.ready != nil {
		o.ready()
	}
	var hold <-chan time.Time
	if o.holdFor > 0 {
		hold = time.After(o.holdFor)
	}
	select {
	case l := <-lost:
		fmt.Fprintln(o.stderr, "vco-agent lease:", l)
		// The engine marks the slot fenced after OnLost returns; a
		// granted taker proceeds on that mark (docs/fencing.md), so it is
		// waited for before the command exits.
		select {
		case <-e.LossHandled():
		case <-time.After(4 * o.timing.IOTimeout):
		}
		return 3
	case <-o.interrupt:
	case <-hold:
	}
	if err := e.Release(context.Background()); err != nil {
		return o.fail(err)
	}
	fmt.Fprintf(o.stdout, "%s released\n", dev.Name())
	return 0
}

func (o *leaseOptions) ok(msg string, extra map[string]any) int {
	f := fenceOutput{o: &fenceOptions{json: o.json}, stdout: o.stdout, stderr: o.stderr}
	return f.ok(msg, extra)
}

func (o *leaseOptions) fail(err error) int {
	f := fenceOutput{o: &fenceOptions{json: o.json}, stdout: o.stdout, stderr: o.stderr}
	if !o.json {
		fmt.Fprintln(o.stderr, "vco-agent lease:", err)
		return 1
	}
	return f.fail(err)
}

func (o *leaseOptions) show(st lease.Status) int {
	// The bounds another node's stage meets: the owner's timing (a taker
	// waits for the holder's figures), else this node's.
	tm, whose := o.timing, "this node's"
	if st.Owner != nil {
		tm, whose = st.Owner.Timing, "the owner's"
	}
	b := tm.Bounds()
	if o.json {
		f := fenceOutput{o: &fenceOptions{json: true}, stdout: o.stdout, stderr: o.stderr}
		return f.writeJSON(map[string]any{"ok": true, "status": st, "bounds_timing": tm, "bounds": b}, 0)
	}
	w := o.stdout
	fmt.Fprintf(w, "device:     %s (lease volume %s; data at byte %d)\n", st.Device, st.VolumeID, lease.DataOffset)
	fmt.Fprintf(w, "this node:  key %s\n", st.OwnKey)
	if st.Owner == nil {
		fmt.Fprintln(w, "owner:      none")
	} else {
		fmt.Fprintf(w, "owner:      key %s (node %s), epoch %d\n", st.Owner.Key, o.nodeName(st.Owner), st.Owner.Epoch)
	}
	fmt.Fprintf(w, "bounds:     with %s timing d=%s R=%s F=%s W=%s (docs/fencing.md):\n", whose, tm.IOTimeout, tm.Renew, tm.Fail, tm.Watchdog)
	fmt.Fprintf(w, "            a live holder refuses another stage within R + d = %s\n", b.Refusal)
	fmt.Fprintf(w, "            a dead, frozen or hung holder (host watchdog armed) is taken over after Expiry + Settle = max(F+W+d, R+6d) + 2d = %s\n", b.DeadTakeover)
	fmt.Fprintf(w, "            a live holder superseded by a grant has let go within max(2d, R) + d/2 = %s plus its drain (R + 5d + d/2 = %s if every lease I/O takes d)\n",
		b.GrantLive, b.GrantLiveSlowIO)
	for _, s := range st.Slots {
		if s.Corrupt {
			fmt.Fprintf(w, "slot %2d:    unreadable (torn or foreign write)\n", s.Index)
			continue
		}
		age := time.Since(time.Unix(0, s.Written)).Round(time.Millisecond)
		fmt.Fprintf(w, "slot %2d:    key %s node %q %s epoch %d counter %d, written %s ago (writer's clock), timing %s\n",
			s.Index, s.Key, o.nodeName(&s.Slot), s.State, s.Epoch, s.Counter, age, s.Timing)
	}
	return 0
}

// watch runs the hot-plug Watcher with a classifier that looks at the
// lease area only (the agent's also asks the reservation engine).
func (o *leaseOptions) watch() int {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if o.rescan <= 0 {
		return o.fail(fmt.Errorf("--rescan %s must be positive", o.rescan))
	}
	w := &uevent.Watcher{
		Groups:     uevent.GroupKernel,
		Match:      o.match,
		Rescan:     o.rescan,
		Classify:   o.classify,
		OnDecision: o.showDecision,
		OnRemove:   func(ev uevent.Event) { fmt.Fprintf(o.stdout, "removed %s (%d:%d)\n", ev.Node(), ev.Major, ev.Minor) },
	}
	errc := make(chan error, 1)
	go func() { errc <- w.Run(ctx) }()
	select {
	case <-w.Ready():
		fmt.Fprintln(o.stdout, "watching for disks")
	case err := <-errc:
		return o.fail(err)
	}
	if o.ready != nil {
		o.ready()
	}
	var hold <-chan time.Time
	if o.holdFor > 0 {
		hold = time.After(o.holdFor)
	}
	select {
	case <-o.interrupt:
	case <-hold:
	case err := <-errc:
		return o.fail(err)
	}
	cancel()
	if err := <-errc; err != nil {
		return o.fail(err)
	}
	return 0
}

// classify is watch's verdict on a disk the kernel announced: refused
// when another node holds its lease.
func (o *leaseOptions) classify(ctx context.Context, ev uevent.Event) (uevent.Verdict, error) {
	s, err := lease.Inspect(ctx, ev.Node(), o.timing.IOTimeout)
	if errors.Is(err, lease.ErrNoLease) {
		return uevent.Verdict{Reason: "no lease area"}, nil
	}
	if err != nil {
		return uevent.Verdict{}, err
	}
	if s == nil {
		return uevent.Verdict{Method: fence.MethodLease, Reason: "lease free"}, nil
	}
	if s.Key == o.key {
		return uevent.Verdict{Method: fence.MethodLease, Holder: s.Key, Reason: "lease held by this node"}, nil
	}
	node := o.nodeName(s)
	return uevent.Verdict{Refuse: true, Method: fence.MethodLease, Holder: s.Key, HolderNode: node,
		Reason: fmt.Sprintf("disk lease held by key %s (node %s)", s.Key, node)}, nil
}

// showDecision prints a line for each of watch's decisions.
func (o *leaseOptions) showDecision(d uevent.Decision) {
	lat := d.Done.Sub(d.Received).Round(10 * time.Microsecond)
	switch {
	case d.Err != nil:
		fmt.Fprintf(o.stdout, "error %s: %v\n", d.Event.Node(), d.Err)
	case d.Verdict.Refuse && d.Cause == uevent.CauseEvent:
		fmt.Fprintf(o.stdout, "refused %s (%d:%d): %s; read-only set %s after the kernel's %s event\n",
			d.Event.Node(), d.Event.Major, d.Event.Minor, d.Verdict.Reason, lat, d.Event.Action)
	case d.Verdict.Refuse:
		fmt.Fprintf(o.stdout, "refused %s (%d:%d): %s; read-only set by the %s\n",
			d.Event.Node(), d.Event.Major, d.Event.Minor, d.Verdict.Reason, d.Cause)
	default:
		fmt.Fprintf(o.stdout, "accepted %s (%d:%d): %s\n", d.Event.Node(), d.Event.Major, d.Event.Minor, d.Verdict.Reason)
	}
}
