package watchdog

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// softIdentity is what softdog calls itself.
const softIdentity = "Software Watchdog"

// Find locates the watchdog device want names (Auto, or a path under dev)
// from sysfs's watchdog class. Auto prefers a hardware (or hypervisor)
// device; without one it uses softdog, loading it with `modprobe softdog`
// when it is not loaded (the package loads it at boot, since the packaged
// unit may not load modules). softdog must reset (soft_noboot=0).
func Find(sysfs, dev, want string) (Info, error) {
	infos, err := scan(sysfs, dev)
	if err != nil {
		return Info{}, err
	}
	if want != Auto && want != "" {
		base := filepath.Base(want)
		if base == "watchdog" {
			// The legacy misc node is the first device's alias.
			base = "watchdog0"
		}
		for _, in := range infos {
			if filepath.Base(in.Path) == base {
				return checkSoft(sysfs, in)
			}
		}
		return Info{}, fmt.Errorf("%s is not a watchdog device of this host (%s lists %s)", want, filepath.Join(sysfs, "class/watchdog"), names(infos))
	}
	if len(infos) == 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		out, err := loadSoftdog(ctx)
		cancel()
		if err != nil {
			return Info{}, fmt.Errorf("%w, and `modprobe softdog` failed (%v: %s): load softdog at boot (the package's /usr/lib/modules-load.d/vco-agent.conf does) or give the host a watchdog device",
				ErrNone, err, strings.TrimSpace(string(out)))
		}
		if infos, err = scan(sysfs, dev); err != nil {
			return Info{}, err
		}
		if len(infos) == 0 {
			return Info{}, fmt.Errorf("%w, even after `modprobe softdog`", ErrNone)
		}
	}
	// Hardware first: it resets a host whose kernel is wedged too.
	slices.SortStableFunc(infos, func(a, b Info) int {
		switch {
		case a.Soft == b.Soft:
			return 0
		case b.Soft:
			return -1
		}
		return 1
	})
	return checkSoft(sysfs, infos[0])
}

func names(infos []Info) string {
	if len(infos) == 0 {
		return "none"
	}
	var n []string
	for _, in := range infos {
		n = append(n, in.Path)
	}
	return strings.Join(n, ", ")
}

// FindActive is the device Find would pick when it is counting down
// already (sysfs state "active"), as an agent that died or stopped while
// it had the device armed leaves it. It loads nothing.
func FindActive(sysfs, dev, want string) (Info, bool) {
	infos, err := scan(sysfs, dev)
	if err != nil || len(infos) == 0 {
		return Info{}, false
	}
	pick := infos[0]
	if want != Auto && want != "" {
		base := filepath.Base(want)
		if base == "watchdog" {
			base = "watchdog0"
		}
		found := false
		for _, in := range infos {
			if filepath.Base(in.Path) == base {
				pick, found = in, true
			}
		}
		if !found {
			return Info{}, false
		}
	} else {
		for _, in := range infos {
			if !in.Soft {
				pick = in
				break
			}
		}
	}
	return pick, pick.Active || pick.StateUnknown
}

// checkSoft refuses softdog loaded to only log (soft_noboot=1).
func checkSoft(sysfs string, in Info) (Info, error) {
	if !in.Soft {
		return in, nil
	}
	b, err := os.ReadFile(filepath.Join(sysfs, "module/softdog/parameters/soft_noboot"))
	if err == nil {
		if v := strings.TrimSpace(string(b)); v == "1" || v == "Y" {
			return Info{}, fmt.Errorf("%s is softdog loaded with soft_noboot=1, which does not reset the host: reload it with soft_noboot=0", in.Path)
		}
	}
	return in, nil
}

// loadSoftdog loads the software watchdog; tests replace it, so that
// none loads a module on the machine they run on.
var loadSoftdog = func(ctx context.Context) ([]byte, error) {
	return exec.CommandContext(ctx, "modprobe", "softdog").CombinedOutput()
}

// scan lists the watchdog class's devices, in index order.
func scan(sysfs, dev string) ([]Info, error) {
	dir := filepath.Join(sysfs, "class/watchdog")
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing the host's watchdog devices: %w", err)
	}
	type indexed struct {
		idx int
		in  Info
	}
	var found []indexed
	for _, e := range ents {
		n := e.Name()
		idx, err := strconv.Atoi(strings.TrimPrefix(n, "watchdog"))
		if !strings.HasPrefix(n, "watchdog") || err != nil || idx < 0 {
			continue
		}
		state := attr(dir, n, "state")
		in := Info{Path: filepath.Join(dev, n), Identity: attr(dir, n, "identity"), Nowayout: attr(dir, n, "nowayout") == "1",
			Active: state == "active", StateUnknown: state == ""}
		in.Soft = in.Identity == softIdentity
		found = append(found, indexed{idx, in})
	}
	slices.SortFunc(found, func(a, b indexed) int { return a.idx - b.idx })
	infos := make([]Info, len(found))
	for i, f := range found {
		infos[i] = f.in
	}
	return infos, nil
}

func attr(dir, dev, name string) string {
	b, _ := os.ReadFile(filepath.Join(dir, dev, name))
	return strings.TrimSpace(string(b))
}

// kernelDevice is an open /dev/watchdogN.
type kernelDevice struct{ fd int }

// Open opens the device, which starts its countdown, and fills in what
// the driver says of itself: identity and whether it honours the magic
// close.
func Open(in Info) (Device, Info, error) {
	fd, err := unix.Open(in.Path, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.EBUSY) {
			err = fmt.Errorf("%w: another program holds it open (systemd's RuntimeWatchdogSec=, a watchdog daemon?); it can serve only one", err)
		}
		return nil, in, err
	}
	if wi, err := unix.IoctlGetWatchdogInfo(fd); err == nil {
		if id := string(bytes.TrimRight(wi.Identity[:], "\x00")); id != "" {
			in.Identity = id
		}
		in.MagicClose = wi.Options&unix.WDIOF_MAGICCLOSE != 0
	}
	return &kernelDevice{fd: fd}, in, nil
}

func (d *kernelDevice) SetTimeout(t time.Duration) (time.Duration, error) {
	secs := int(t / time.Second)
	if err := unix.IoctlSetPointerInt(d.fd, unix.WDIOC_SETTIMEOUT, secs); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
		return 0, fmt.Errorf("setting its timeout to %d s: %w", secs, err)
	}
	got, err := unix.IoctlGetInt(d.fd, unix.WDIOC_GETTIMEOUT)
	if err != nil {
		return 0, fmt.Errorf("reading its timeout back: %w", err)
	}
	return time.Duration(got) * time.Second, nil
}

func (d *kernelDevice) Feed() error { return unix.IoctlWatchdogKeepalive(d.fd) }

func (d *kernelDevice) Disarm() error {
	_, werr := unix.Write(d.fd, []byte("V"))
	cerr := unix.Close(d.fd)
	return errors.Join(werr, cerr)
}

func (d *kernelDevice) Close() error { return unix.Close(d.fd) }
