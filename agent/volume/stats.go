package volume

// NodeGetVolumeStats: a staged volume's usage and health.

import (
	"context"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// Stats is GetVolumeStats's answer.
type Stats struct {
	TotalBytes, UsedBytes, AvailableBytes    int64
	TotalInodes, UsedInodes, AvailableInodes int64
	Block                                    bool
	Abnormal                                 bool
	Message                                  string
	// State is the claim's state (Claim.ListState): "lost" or "gone"
	// says why an abnormal volume is so.
	State string
}

// Stats implements GetVolumeStats. It takes no lock: it only reads.
func (m *Manager) Stats(ctx context.Context, volume, path string) (Stats, error) {
	var st Stats
	if volume == "" {
		return st, agenterr.New(agenterr.InvalidArgument, "a volume id is required")
	}
	c, err := m.store.Get(volume)
	if err != nil {
		return st, err
	}
	if c == nil || c.Phase != PhaseStaged {
		return st, agenterr.New(agenterr.NotFound, "volume %s is not staged on this node", volume)
	}
	p, err := m.volumePath(c, path)
	if err != nil {
		return st, err
	}
	st.Block, st.State = c.Block, c.ListState()
	if c.Abnormal() {
		st.Abnormal, st.Message = true, c.Detail
	} else if err := m.sourceIntact(c); agenterr.KindOf(err) == agenterr.FailedPrecondition {
		// Its disk is back, but what the volume is mounted or mapped
		// from is the device that left (stagingHolds, blockIntact).
		st.Abnormal, st.Message = true, err.Error()
	}
	if c.Block {
		n, err := m.host.Size(c.MountDevice())
		if err != nil && !st.Abnormal {
			return st, agenterr.New(agenterr.NotFound, "volume %s: %v", volume, err)
		}
		st.TotalBytes = n
		return st, nil
	}
	var s unix.Statfs_t
	if err := unix.Statfs(p, &s); err != nil {
		if st.Abnormal {
			return st, nil
		}
		return st, agenterr.New(agenterr.NotFound, "volume %s: statfs %s: %v", volume, p, err)
	}
	bs := int64(s.Bsize)
	st.TotalBytes = int64(s.Blocks) * bs
	st.AvailableBytes = int64(s.Bavail) * bs
	st.UsedBytes = (int64(s.Blocks) - int64(s.Bfree)) * bs
	st.TotalInodes = int64(s.Files)
	st.AvailableInodes = int64(s.Ffree)
	st.UsedInodes = int64(s.Files) - int64(s.Ffree)
	return st, nil
}
