package agentnode

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
)

// groupHint says, when a process that is not root lacks the group of the
// agent socket's directory, which gid that is and where the node pod
// gets it, so that a node whose vco-agent group has another gid than the
// pod's is named as such. Empty when the groups are not the problem.
func groupHint(socket string, uid, gid int, groups []int) string {
	dir := filepath.Dir(socket)
	fi, err := os.Stat(dir)
	if err != nil || uid == 0 {
		return ""
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || int(st.Gid) == gid || slices.Contains(groups, int(st.Gid)) {
		return ""
	}
	return fmt.Sprintf("; %s belongs to gid %d, and this process, uid %d, has gid %d and groups %v: give the node pod the vco-agent group's gid "+
		"of this node in supplementalGroups (make csi-addon VCO_AGENT_GID=%d), the same on every node (docs/csi-addon.md, \"Users and groups\")",
		dir, st.Gid, uid, gid, groups, st.Gid)
}

// processGroupHint is groupHint for this process.
func processGroupHint(socket string) string {
	groups, _ := os.Getgroups()
	return groupHint(socket, os.Geteuid(), os.Getegid(), groups)
}
