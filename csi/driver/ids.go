package driver

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"google.golang.org/protobuf/types/known/wrapperspb"
)

func wrapBool(b bool) *wrapperspb.BoolValue { return wrapperspb.Bool(b) }

// A volume ID is "<location>/<disk id>": the controller can reach the disk
// from the ID alone, without a lookup across locations.
func volumeID(loc string, disk int64) string { return loc + "/" + strconv.FormatInt(disk, 10) }

func parseVolumeID(id string) (loc string, disk int64, ok bool) {
	loc, rest, found := strings.Cut(id, "/")
	if !found || loc == "" {
		return "", 0, false
	}
	n, err := strconv.ParseInt(rest, 10, 64)
	if err != nil || n <= 0 {
		return "", 0, false
	}
	return loc, n, true
}

// A snapshot ID is "<location>/<disk id>/<snapshot id>".
func snapshotID(loc string, disk int64, snap string) string {
	return volumeID(loc, disk) + "/" + snap
}

func parseSnapshotID(id string) (loc string, disk int64, snap string, ok bool) {
	i := strings.LastIndexByte(id, '/')
	if i < 0 || i == len(id)-1 {
		return "", 0, "", false
	}
	loc, disk, ok = parseVolumeID(id[:i])
	return loc, disk, id[i+1:], ok
}

// The disk description records what the plugin needs to answer for the
// disk later: that it made it, whether the volume is encrypted and where it
// came from. It is how ListVolumes tells its own disks from others, and how
// a repeated CreateVolume checks it asks for the same thing.
const descPrefix = "vco-csi:"

type diskMeta struct {
	Encrypted bool
	Source    string // "snapshot:<id>" or "volume:<id>" or ""
}

func (m diskMeta) description() string {
	v := url.Values{}
	if m.Encrypted {
		v.Set("encrypted", "true")
	}
	if m.Source != "" {
		v.Set("source", m.Source)
	}
	return descPrefix + v.Encode()
}

func parseDescription(s string) (diskMeta, bool) {
	rest, ok := strings.CutPrefix(s, descPrefix)
	if !ok {
		return diskMeta{}, false
	}
	v, err := url.ParseQuery(rest)
	if err != nil {
		return diskMeta{}, false
	}
	return diskMeta{Encrypted: v.Get("encrypted") == "true", Source: v.Get("source")}, true
}

// maxIDBytes is the CSI spec's bound on names and IDs the CO passes.
const maxIDBytes = 128

// checkName refuses a volume name the API should never see: longer than
// the CSI bound, or holding control characters (NUL among them).
func checkName(name string) error {
	if len(name) > maxIDBytes {
		return failf(ErrInvalid, "volume name of %d bytes is longer than %d", len(name), maxIDBytes)
	}
	if i := strings.IndexFunc(name, func(r rune) bool { return r < 0x20 || r == 0x7f }); i >= 0 {
		return failf(ErrInvalid, "volume name %s holds a control character at byte %d", shortQuote(name), i)
	}
	return nil
}

// checkNodeVolumeID refuses, before the agent is asked, a volume ID that
// this driver's controller cannot have made.
func checkNodeVolumeID(id string) error {
	if len(id) > maxIDBytes {
		return failf(ErrInvalid, "volume id of %d bytes is longer than %d", len(id), maxIDBytes)
	}
	if _, _, ok := parseVolumeID(id); !ok {
		if _, legacy := legacyDiskID(id); !legacy {
			return failf(ErrInvalid, "volume id %s is not <location>/<disk id> (nor a bare disk id, as the earlier driver's)", shortQuote(id))
		}
	}
	return nil
}

// shortQuote quotes s for an error message, cut to a readable length.
func shortQuote(s string) string {
	if len(s) > 64 {
		return fmt.Sprintf("%q...", s[:64])
	}
	return fmt.Sprintf("%q", s)
}
