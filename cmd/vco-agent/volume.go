package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
)

// The volume subcommands make the running agent's volume calls from a
// shell, as the CSI node plugin makes them over the socket: for operators
// who stage a volume by hand, and for the lab.

const volumeUsage = `usage: vco-agent volume <token|stage|unstage|expand|stats> VOLUME [flags]

  token    what the volume's device holds where LUKS2 goes, and the header's
           transit token (the wrapped passphrase)
  stage    find, fence, open LUKS2 (--passphrase-file), format only a blank
           device, mount at --staging
  unstage  unmount, close LUKS2, release the fence
  expand   grow the dm-crypt mapping and the filesystem online
  stats    usage, and whether the volume is abnormal

The device is named by --serial, --pci and --wwn (every one given must
match). Passphrases come from a file ("-" for stdin), never an argument.
A takeover grant is --grant-node and --grant-supersedes (as the
controller's publish context carries it). The first stage of a blank encrypted volume also needs --format-if-blank
and the wrapped passphrase: --wrapped-file (a transit ciphertext),
--transit-key and --transit-key-version.

flags:
`

type volumeOptions struct {
	socket, serial, pci, wwn, loop   string
	staging, fsType, passFile        string
	wrappedFile, transitKey, mount   string
	keyVersion                       uint
	block, readOnly, format, unfence bool
	path                             string
	required                         int64
	mountFlags                       multiFlag
	json                             bool
	timeout                          time.Duration
	grantNode                        string
	grantKeys                        multiFlag
}

func runVolume(args []string) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stderr, volumeUsage)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	sub := args[0]
	var o volumeOptions
	fs := o.flags(sub)
	// The volume id comes first, flags after it.
	if len(args) < 2 || strings.HasPrefix(args[1], "-") {
		fmt.Fprintf(stderr, "vco-agent volume %s: the volume id comes first\n", sub)
		return 2
	}
	vol := args[1]
	if err := fs.Parse(args[2:]); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "vco-agent volume %s: unexpected argument %q\n", sub, fs.Arg(0))
		return 2
	}
	c, err := client.Dial(o.socket)
	if err != nil {
		return fail("volume", err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	call, ok := volumeCalls[sub]
	if !ok {
		fmt.Fprintf(stderr, "vco-agent volume: unknown subcommand %q\n\n%s", sub, volumeUsage)
		return 2
	}
	out, err := call(ctx, &o, c, vol)
	if err != nil {
		return fail("volume "+sub, err)
	}
	if out != nil {
		b, _ := json.Marshal(out)
		fmt.Fprintln(stdout, string(b))
	}
	return 0
}

// flags are the flags of volume sub, set into o.
func (o *volumeOptions) flags(sub string) *flag.FlagSet {
	fs := flag.NewFlagSet("volume "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, volumeUsage); fs.PrintDefaults() }
	fs.StringVar(&o.socket, "socket", client.DefaultSocket, "the agent's API socket")
	fs.StringVar(&o.serial, "serial", "", "the disk's serial")
	fs.StringVar(&o.pci, "pci", "", "the disk's PCI address")
	fs.StringVar(&o.wwn, "wwn", "", "the disk's WWN")
	fs.StringVar(&o.loop, "loop-backing-file", "", "a loop device's backing file (agents with volumes.allow_loop_devices)")
	fs.StringVar(&o.staging, "staging", "", "the staging path: <kubelet root>/plugins/kubernetes.io/csi/<driver>/<hash>/globalmount, with --block <kubelet root>/plugins/kubernetes.io/csi/volumeDevices/staging/<pv>")
	fs.StringVar(&o.fsType, "fs", "", "ext4 (default) or xfs")
	fs.BoolVar(&o.block, "block", false, "a raw block volume")
	fs.BoolVar(&o.readOnly, "read-only", false, "stage read-only")
	fs.Var(&o.mountFlags, "mount-flag", "a mount option (repeatable)")
	fs.StringVar(&o.passFile, "passphrase-file", "", "the encrypted volume's passphrase (\"-\" for stdin)")
	fs.BoolVar(&o.format, "format-if-blank", false, "give a blank device a LUKS2 header")
	fs.StringVar(&o.wrappedFile, "wrapped-file", "", "the passphrase wrapped by the transit engine (vault:vN:...)")
	fs.StringVar(&o.transitKey, "transit-key", "", "the transit key that wrapped the passphrase")
	fs.UintVar(&o.keyVersion, "transit-key-version", 0, "the version of that key")
	fs.StringVar(&o.mount, "transit-mount", "transit", "the transit engine's mount path")
	fs.BoolVar(&o.unfence, "allow-unfenced", false, "stage a disk with no fencing (the agent must allow it too)")
	fs.StringVar(&o.path, "path", "", "expand, stats: the staging or a target path")
	fs.Int64Var(&o.required, "required-bytes", 0, "expand: the size the disk was grown to")
	fs.StringVar(&o.grantNode, "grant-node", "", "stage: the SMBIOS UUID the controller's takeover grant is for")
	fs.Var(&o.grantKeys, "grant-supersedes", "stage: a fence key the grant lets this node take over (repeatable)")
	fs.BoolVar(&o.json, "json", false, "print JSON")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long to wait for the agent")
	return fs
}

// volumeCalls make each subcommand's call. A call returns what is printed
// as JSON, or nil when it printed its answer as text.
var volumeCalls = map[string]func(ctx context.Context, o *volumeOptions, c *client.Client, vol string) (any, error){
	"token":   volumeToken,
	"stage":   volumeStage,
	"unstage": volumeUnstage,
	"expand":  volumeExpand,
	"stats":   volumeStats,
}

func (o *volumeOptions) locator() *api.DeviceLocator {
	return &api.DeviceLocator{PciAddress: o.pci, Serial: o.serial, Wwn: o.wwn, LoopBackingFile: o.loop}
}

func volumeToken(ctx context.Context, o *volumeOptions, c *client.Client, vol string) (any, error) {
	r, err := c.GetVolumeToken(ctx, &api.GetVolumeTokenRequest{VolumeId: vol, Device: o.locator()})
	if err != nil {
		return nil, apiError(o.socket, err)
	}
	if o.json {
		return protoJSON(r), nil
	}
	fmt.Fprintf(stdout, "%s on %s: %s", vol, r.Device, strings.ToLower(strings.TrimPrefix(r.Content.String(), "VOLUME_CONTENT_")))
	if t := r.TransitToken; t != nil {
		fmt.Fprintf(stdout, ", transit key %s/%s version %d", t.Mount, t.KeyName, t.KeyVersion)
	}
	if r.Detail != "" {
		fmt.Fprintf(stdout, " (%s)", r.Detail)
	}
	fmt.Fprintln(stdout)
	return nil, nil
}

func volumeStage(ctx context.Context, o *volumeOptions, c *client.Client, vol string) (any, error) {
	req := &api.StageVolumeRequest{VolumeId: vol, Device: o.locator(), StagingPath: o.staging, FsType: o.fsType, Block: o.block,
		MountFlags: o.mountFlags, ReadOnly: o.readOnly, AllowUnfenced: o.unfence}
	if len(o.grantKeys) > 0 {
		req.Grant = &api.TakeoverGrant{Disk: vol, Node: o.grantNode, Supersedes: o.grantKeys}
	}
	if o.passFile != "" {
		enc, err := o.encryption()
		if err != nil {
			return nil, err
		}
		defer clear(enc.Passphrase)
		req.Encryption = enc
	}
	var r *api.StageVolumeResponse
	err := client.AskAgain(ctx, func(ctx context.Context) (err error) { r, err = c.StageVolume(ctx, req); return err })
	if err != nil {
		return nil, apiError(o.socket, err)
	}
	if o.json {
		return protoJSON(r), nil
	}
	fmt.Fprintf(stdout, "%s staged from %s at %s, fenced by %s, formatted %v\n", vol, r.Device, o.staging, fencingName(r.Fencing), r.Formatted)
	return nil, nil
}

// encryption is a stage's encryption: the passphrase from
// --passphrase-file and, with --wrapped-file, its transit token.
func (o *volumeOptions) encryption() (*api.Encryption, error) {
	pass, err := luksCLI{stdin: os.Stdin}.readPassphrase(o.passFile, "passphrase")
	if err != nil {
		return nil, err
	}
	enc := &api.Encryption{Passphrase: pass, FormatIfBlank: o.format}
	if o.wrappedFile != "" {
		w, err := os.ReadFile(o.wrappedFile)
		if err != nil {
			clear(pass)
			return nil, err
		}
		enc.TransitToken = &api.TransitToken{Mount: o.mount, KeyName: o.transitKey, KeyVersion: uint32(o.keyVersion),
			Ciphertext: strings.TrimSpace(string(w))}
	}
	return enc, nil
}

func volumeUnstage(ctx context.Context, o *volumeOptions, c *client.Client, vol string) (any, error) {
	if err := client.AskAgain(ctx, func(ctx context.Context) error {
		_, err := c.UnstageVolume(ctx, &api.UnstageVolumeRequest{VolumeId: vol, StagingPath: o.staging})
		return err
	}); err != nil {
		return nil, apiError(o.socket, err)
	}
	if o.json {
		return map[string]any{"ok": true}, nil
	}
	fmt.Fprintf(stdout, "%s unstaged\n", vol)
	return nil, nil
}

func volumeExpand(ctx context.Context, o *volumeOptions, c *client.Client, vol string) (any, error) {
	var r *api.ExpandVolumeResponse
	err := client.AskAgain(ctx, func(ctx context.Context) (err error) {
		r, err = c.ExpandVolume(ctx, &api.ExpandVolumeRequest{VolumeId: vol, VolumePath: o.path, RequiredBytes: o.required})
		return err
	})
	if err != nil {
		return nil, apiError(o.socket, err)
	}
	if o.json {
		return protoJSON(r), nil
	}
	fmt.Fprintf(stdout, "%s: %d bytes\n", vol, r.CapacityBytes)
	return nil, nil
}

func volumeStats(ctx context.Context, o *volumeOptions, c *client.Client, vol string) (any, error) {
	r, err := c.GetVolumeStats(ctx, &api.GetVolumeStatsRequest{VolumeId: vol, VolumePath: o.path})
	if err != nil {
		return nil, apiError(o.socket, err)
	}
	return protoJSON(r), nil
}
