package volume

import (
	"context"
	"errors"
	"io"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/fence/discovery"
	"github.com/whitesky-cloud/vco-storage/fence/pr"
)

// DiskInfo is one line of ListDisks.
type DiskInfo struct {
	Device     string
	Name       string
	Kind       string
	PCI        string
	Serial     string
	WWNs       []string
	Method     fence.Method
	State      string // unclaimed, held, unfenced, lost, gone, unreadable (its record), or the claim's phase
	Volume     string
	Staging    string
	HolderKey  fence.Key
	HolderNode string
	Detail     string
	FsType     string
	Encrypted  bool
	ReadOnly   bool
}

// Disks lists every disk the agent sees and every claim it holds. An
// unclaimed disk is probed read-only for its fencing method and holder; a
// claimed disk is described from its claim, so that no second reader of the
// reservation consumes a unit attention meant for the claim's own checks.
// A claim record that cannot be read is listed as unreadable, with why:
// its volume's disk is left alone, and the operator must see that.
func (m *Manager) Disks(ctx context.Context) ([]DiskInfo, error) {
	claims, errs := m.store.List()
	byDev := map[string]*Claim{}
	for _, c := range claims {
		byDev[c.DevNum] = c
	}
	disks, err := m.finder.List()
	if err != nil {
		return nil, err
	}
	var out []DiskInfo
	for _, d := range disks {
		di := DiskInfo{Device: d.DevPath, Name: d.Name, Kind: string(d.Kind), Serial: d.Serial, WWNs: d.WWNs}
		if d.PCI != nil {
			di.PCI = d.PCI.String()
		}
		if c := byDev[fmtDevnum(d.Major, d.Minor)]; c != nil {
			delete(byDev, c.DevNum)
			fromClaim(&di, c)
			if l := m.getLive(c.Volume); l != nil {
				if e, ok := l.fencer.(*pr.Engine); ok {
					if st, err := e.Status(ctx); err == nil && st.Reservation != nil {
						di.HolderKey, di.HolderNode = st.Reservation.Key, st.Reservation.Node
					}
				}
			}
			out = append(out, di)
			continue
		}
		di.State = "unclaimed"
		m.probe(ctx, d, &di)
		out = append(out, di)
	}
	for _, c := range claims {
		if byDev[c.DevNum] == c {
			di := DiskInfo{Device: c.Device, Serial: c.Serial}
			if l := m.getLive(c.Volume); l != nil {
				di.Name, di.Kind = l.dev.Name, string(l.dev.Kind)
			}
			fromClaim(&di, c)
			out = append(out, di)
		}
	}
	for _, err := range errs {
		var re *RecordError
		if errors.As(err, &re) {
			out = append(out, DiskInfo{Volume: re.Volume, State: "unreadable", Detail: re.Error()})
		}
	}
	return out, nil
}

// ListState is the claim's state as ListDisks and GetVolumeStats report
// it: the phase until staged, "gone" for a device that disappeared (unless
// the claim was lost, which says more), else the fence state.
func (c *Claim) ListState() string {
	switch {
	case c.Phase != PhaseStaged:
		return string(c.Phase)
	case c.Missing && c.State != StateLost:
		return "gone"
	default:
		return string(c.State)
	}
}

func fromClaim(di *DiskInfo, c *Claim) {
	di.Method, di.Volume, di.Staging, di.FsType, di.Encrypted, di.ReadOnly = c.Method, c.Volume, c.StagingPath, c.FsType, c.Encrypted, c.ReadOnly
	di.Detail = c.Detail
	di.State = c.ListState()
	if c.State == StateHeld {
		di.HolderKey, di.HolderNode = c.Key, "this node"
	}
	if c.State == StateLost {
		di.HolderKey, di.HolderNode = c.HolderKey, c.HolderNode
	}
}

// probe reads an unclaimed disk's fencing method and holder without
// changing anything.
func (m *Manager) probe(ctx context.Context, d discovery.Disk, di *DiskInfo) {
	o, err := m.finder.Open(ctx, d, discovery.Locator{})
	if err != nil {
		di.Detail = err.Error()
		return
	}
	defer o.Close()
	dev := &Device{Path: d.DevPath, Name: d.Name, Major: d.Major, Minor: d.Minor, Kind: d.Kind, File: o.File, SCSI: o.SCSI, Verify: o.Verify}
	ch, err := m.o.Fencers.Choose(ctx, dev, LookOnly, nil)
	if err != nil {
		di.Detail = err.Error()
		return
	}
	if cl, ok := ch.Fencer.(io.Closer); ok {
		defer cl.Close()
	}
	di.Method, di.Detail = ch.Method, ch.Reason
	switch e := ch.Fencer.(type) {
	case *pr.Engine:
		if st, err := e.Status(ctx); err == nil && st.Reservation != nil {
			di.HolderKey, di.HolderNode = st.Reservation.Key, st.Reservation.Node
		}
	case *leaseFencer:
		if owner, err := e.Holder(ctx); err == nil && owner != nil && owner.Live() {
			di.HolderKey, di.HolderNode = owner.Key, owner.Node
		}
	}
	// A disk refused on arrival stays read-only on this host.
	if ro, err := readOnly(o.File); err == nil && ro {
		di.ReadOnly = true
		if di.HolderKey != 0 {
			di.State = "refused"
		}
	}
}

func fmtDevnum(ma, mi uint32) string {
	return (&Device{Major: ma, Minor: mi}).DevNum()
}
