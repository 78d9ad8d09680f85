// Package uevent receives device events from the kernel and from udev over
// netlink, so that the agent sees a disk the moment it is hot-plugged and
// can refuse it (read-only at the block layer) before anything on the node
// uses it; the Watcher also classifies the disks already attached (listed
// in sysfs) at start, after lost events and periodically. It talks to the socket with golang.org/x/sys/unix directly: the
// protocol is two small message formats, and the Go libraries for it are
// not available from the module proxy this project builds with.
//
// Two multicast groups of NETLINK_KOBJECT_UEVENT carry events: group 1 has
// the kernel's own ("add@/devices/...\0ACTION=add\0..."), sent before udev
// has run its rules; group 2 has udev's, sent after its rules ran, with the
// properties the rules added (ID_SERIAL, SYSTEMD_READY, ...) behind a
// binary "libudev" header. Parse reads both. Only messages from the kernel
// (netlink port 0) or from a root-owned process are accepted.
package uevent

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Source says which group an event came from.
type Source int

const (
	// Kernel events (multicast group 1).
	Kernel Source = 1
	// Udev events (multicast group 2), after udev's rules ran.
	Udev Source = 2
	// Scan is a device the Watcher found listed in sysfs, not announced.
	Scan Source = 3
)

func (s Source) String() string {
	switch s {
	case Kernel:
		return "kernel"
	case Udev:
		return "udev"
	case Scan:
		return "sysfs scan"
	}
	return fmt.Sprintf("source %d", int(s))
}

// Event is one uevent.
type Event struct {
	Source    Source
	Action    string // add, remove, change, move, online, offline, bind, unbind
	DevPath   string // /devices/..., relative to /sys
	Subsystem string
	DevName   string // node name under /dev, e.g. "vdb"
	DevType   string // "disk", "partition", ...
	// Major and Minor are the device number; HasDevnum says whether the
	// event carried one.
	Major, Minor uint32
	HasDevnum    bool
	Seqnum       uint64
	// Env holds every KEY=VALUE of the event, including the ones above.
	Env map[string]string
}

// Node is the device node path, or "" when the event names none.
func (e Event) Node() string {
	if e.DevName == "" {
		return ""
	}
	if strings.HasPrefix(e.DevName, "/") {
		return e.DevName
	}
	return "/dev/" + e.DevName
}

// Disk reports whether the event is about a whole block device.
func (e Event) Disk() bool { return e.Subsystem == "block" && e.DevType == "disk" }

const (
	udevPrefix = "libudev\x00"
	udevMagic  = 0xfeedcafe
	// The header is prefix, magic, header size, properties offset and
	// length, then filter hashes we do not use.
	udevMinHeader = 8 + 4*4
	maxEventSize  = 1 << 20
)

// ErrNotUevent is wrapped by Parse for input that is neither format.
var ErrNotUevent = errors.New("not a uevent message")

// Parse decodes one netlink message of either group.
func Parse(b []byte) (Event, error) {
	if len(b) > maxEventSize {
		return Event{}, fmt.Errorf("%w: %d bytes", ErrNotUevent, len(b))
	}
	if bytes.HasPrefix(b, []byte(udevPrefix)) {
		return parseUdev(b)
	}
	return parseKernel(b)
}

func parseKernel(b []byte) (Event, error) {
	first, rest, _ := bytes.Cut(b, []byte{0})
	action, devpath, ok := strings.Cut(string(first), "@")
	if !ok || action == "" || !strings.HasPrefix(devpath, "/") {
		return Event{}, fmt.Errorf("%w: kernel message does not start with ACTION@DEVPATH", ErrNotUevent)
	}
	ev, err := parseEnv(rest, Kernel)
	if err != nil {
		return Event{}, err
	}
	if ev.Action != action || ev.DevPath != devpath {
		return Event{}, fmt.Errorf("%w: header %q disagrees with ACTION=%q DEVPATH=%q", ErrNotUevent, first, ev.Action, ev.DevPath)
	}
	return ev, nil
}

func parseUdev(b []byte) (Event, error) {
	if len(b) < udevMinHeader {
		return Event{}, fmt.Errorf("%w: udev message shorter than its header", ErrNotUevent)
	}
	if binary.BigEndian.Uint32(b[8:]) != udevMagic {
		return Event{}, fmt.Errorf("%w: udev message has a wrong magic", ErrNotUevent)
	}
	// The remaining header fields are in the sender's byte order, which is
	// ours: the message never leaves the host.
	hsize := binary.NativeEndian.Uint32(b[12:])
	off := binary.NativeEndian.Uint32(b[16:])
	n := binary.NativeEndian.Uint32(b[20:])
	if hsize < udevMinHeader || uint64(off) < uint64(hsize) || uint64(off)+uint64(n) > uint64(len(b)) {
		return Event{}, fmt.Errorf("%w: udev header (size %d, properties %d+%d) does not fit the %d-byte message", ErrNotUevent, hsize, off, n, len(b))
	}
	return parseEnv(b[off:off+n], Udev)
}

func parseEnv(b []byte, src Source) (Event, error) {
	ev := Event{Source: src, Env: map[string]string{}}
	for _, f := range bytes.Split(b, []byte{0}) {
		if len(f) == 0 {
			continue
		}
		k, v, ok := strings.Cut(string(f), "=")
		if !ok || k == "" {
			return Event{}, fmt.Errorf("%w: field %q is not KEY=VALUE", ErrNotUevent, f)
		}
		ev.Env[k] = v
	}
	ev.Action, ev.DevPath, ev.Subsystem = ev.Env["ACTION"], ev.Env["DEVPATH"], ev.Env["SUBSYSTEM"]
	ev.DevName, ev.DevType = ev.Env["DEVNAME"], ev.Env["DEVTYPE"]
	if ev.Action == "" || !strings.HasPrefix(ev.DevPath, "/") {
		return Event{}, fmt.Errorf("%w: no ACTION or DEVPATH", ErrNotUevent)
	}
	if s, ok := ev.Env["SEQNUM"]; ok {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return Event{}, fmt.Errorf("%w: SEQNUM %q", ErrNotUevent, s)
		}
		ev.Seqnum = v
	}
	ma, hasMa := ev.Env["MAJOR"]
	mi, hasMi := ev.Env["MINOR"]
	if hasMa != hasMi {
		return Event{}, fmt.Errorf("%w: MAJOR without MINOR or the reverse", ErrNotUevent)
	}
	if hasMa {
		a, err1 := strconv.ParseUint(ma, 10, 32)
		i, err2 := strconv.ParseUint(mi, 10, 32)
		if err1 != nil || err2 != nil {
			return Event{}, fmt.Errorf("%w: device number %q:%q", ErrNotUevent, ma, mi)
		}
		ev.Major, ev.Minor, ev.HasDevnum = uint32(a), uint32(i), true
	}
	return ev, nil
}

// encodeKernel and encodeUdev build messages the way the kernel and
// systemd-udevd do; tests and the fuzz corpus use them.
func encodeKernel(env [][2]string) []byte {
	var b bytes.Buffer
	var action, devpath string
	for _, kv := range env {
		switch kv[0] {
		case "ACTION":
			action = kv[1]
		case "DEVPATH":
			devpath = kv[1]
		}
	}
	b.WriteString(action + "@" + devpath)
	b.WriteByte(0)
	for _, kv := range env {
		b.WriteString(kv[0] + "=" + kv[1])
		b.WriteByte(0)
	}
	return b.Bytes()
}

func encodeUdev(env [][2]string) []byte {
	var props bytes.Buffer
	for _, kv := range env {
		props.WriteString(kv[0] + "=" + kv[1])
		props.WriteByte(0)
	}
	const hsize = 40
	h := make([]byte, hsize)
	copy(h, udevPrefix)
	binary.BigEndian.PutUint32(h[8:], udevMagic)
	binary.NativeEndian.PutUint32(h[12:], hsize)
	binary.NativeEndian.PutUint32(h[16:], hsize)
	binary.NativeEndian.PutUint32(h[20:], uint32(props.Len()))
	return append(h, props.Bytes()...)
}
