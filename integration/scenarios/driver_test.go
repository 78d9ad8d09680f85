package scenarios

import (
	"context"
	"crypto/sha256"
	"fmt"
	"strings"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// outcome is the result of an acquire attempt.
type outcome struct {
	Won    bool
	Holder string // the key holding the disk afterwards, 0x-prefixed lower-case hex
	// HolderNode is the holder's node name, from drivers that map keys to
	// nodes (NamesNodes).
	HolderNode string
	// Preempted lists the keys a granted takeover removed (engine only).
	Preempted []string
	Output    string // what the tool printed, for failure messages
}

// fenceDriver drives a fencing implementation inside a guest. The
// scenarios are written against it so that the same steps run with the
// reference tool (sg_persist) and with the project's engine.
type fenceDriver interface {
	Name() string
	// NamesNodes says whether refusals name the holder's node as well.
	NamesNodes() bool
	// Key is the reservation key the driver uses for guest g.
	Key(g *lab.Guest) string
	// Probe reports whether the disk supports persistent reservations.
	Probe(ctx context.Context, g *lab.Guest, dev string) (pr bool, detail string, err error)
	// Acquire claims dev for g; grant lists keys g may preempt.
	Acquire(ctx context.Context, g *lab.Guest, dev string, grant ...string) (outcome, error)
	Release(ctx context.Context, g *lab.Guest, dev string) error
	// Check reports whether g's claim on dev is intact.
	Check(ctx context.Context, g *lab.Guest, dev string) (intact bool, detail string, err error)
}

// sgPersistDriver follows docs/fencing.md's PR flow with sg3-utils'
// sg_persist in the guest: the reference implementation, and the proof
// that the lab carries every PR command a fencing engine needs to the
// target. Its keys are 0x5643 followed by 6 bytes of a hash of the node's
// SMBIOS UUID.
type sgPersistDriver struct{}

func (sgPersistDriver) Name() string { return "sg_persist" }

func (sgPersistDriver) NamesNodes() bool { return false }

func (sgPersistDriver) Key(g *lab.Guest) string {
	h := sha256.Sum256([]byte(strings.ToLower(g.UUID)))
	return fmt.Sprintf("0x5643%x", h[:6])
}

func (sgPersistDriver) Probe(ctx context.Context, g *lab.Guest, dev string) (bool, string, error) {
	r, err := g.Sh(ctx, "sg_persist -n -i -c "+dev+" 2>&1")
	if err != nil {
		return false, "", err
	}
	return r.Exit == 0, strings.TrimSpace(r.Stdout), nil
}

// sgAcquireScript is one exec call so that two guests racing run the whole
// sequence at once: read the holder; a foreign holder is refused unless the
// grant names it (then PREEMPT AND ABORT, falling back to PREEMPT, which
// tgt needs); else REGISTER AND IGNORE EXISTING KEY and RESERVE Write
// Exclusive; re-read to verify. A loser unregisters again.
const sgAcquireScript = `dev=$1; me=$2; shift 2; grant="$*"
holder() { sg_persist -n -i -r "$dev" | sed -n 's/^ *Key=\(0x[0-9a-f]*\).*/\1/p'; }
h=$(holder)
if [ -n "$h" ] && [ "$h" != "$me" ]; then
	granted=
	for k in $grant; do [ "$k" = "$h" ] && granted=1; done
	if [ -z "$granted" ]; then echo "REFUSED $h"; exit 1; fi
	sg_persist -n -o -I -S "$me" "$dev" >&2 || exit 3
	sg_persist -n -o -A -T 1 -K "$me" -S "$h" "$dev" >&2 || sg_persist -n -o -P -T 1 -K "$me" -S "$h" "$dev" >&2 || { echo "REFUSED $(holder)"; exit 1; }
elif [ -z "$h" ]; then
	sg_persist -n -o -I -S "$me" "$dev" >&2 || exit 3
	if ! sg_persist -n -o -R -T 1 -K "$me" "$dev" >&2; then
		h=$(holder)
		sg_persist -n -o -G -K "$me" -S 0 "$dev" >&2
		echo "REFUSED $h"; exit 1
	fi
fi
h=$(holder)
if [ "$h" = "$me" ]; then echo "WON $me"; exit 0; fi
echo "REFUSED $h"; exit 1`

func (d sgPersistDriver) Acquire(ctx context.Context, g *lab.Guest, dev string, grant ...string) (outcome, error) {
	argv := append([]string{"/bin/sh", "-c", sgAcquireScript, "acquire", dev, d.Key(g)}, grant...)
	r, err := g.Exec().Run(ctx, 0, argv...)
	if err != nil {
		return outcome{}, err
	}
	o := outcome{Output: r.Stdout + r.Stderr}
	f := strings.Fields(r.Stdout)
	switch {
	case r.Exit == 0 && len(f) == 2 && f[0] == "WON":
		o.Won, o.Holder = true, f[1]
	case r.Exit == 1 && len(f) >= 1 && f[0] == "REFUSED":
		if len(f) == 2 {
			o.Holder = f[1]
		}
	default:
		return o, fmt.Errorf("%s: acquire of %s failed: %s", g.Name, dev, r)
	}
	return o, nil
}

func (d sgPersistDriver) Release(ctx context.Context, g *lab.Guest, dev string) error {
	k := d.Key(g)
	// RELEASE of a reservation we do not hold is a no-op for the target;
	// unregistering an unregistered key is refused, so it is allowed to fail
	// only when the key is not registered.
	_, err := g.MustSh(ctx, "sg_persist -n -o -L -T 1 -K "+k+" "+dev+" >/dev/null 2>&1; "+
		"if sg_persist -n -i -k "+dev+" | grep -q '^ *"+k+"$'; then sg_persist -n -o -G -K "+k+" -S 0 "+dev+"; fi")
	return err
}

func (d sgPersistDriver) Check(ctx context.Context, g *lab.Guest, dev string) (bool, string, error) {
	k := d.Key(g)
	out, err := g.MustSh(ctx, "sg_persist -n -i -k "+dev+"; sg_persist -n -i -r "+dev)
	if err != nil {
		return false, "", err
	}
	registered := strings.Contains(out, "\n    "+k+"\n")
	holds := strings.Contains(out, "Key="+k+"\n")
	return registered && holds, out, nil
}
