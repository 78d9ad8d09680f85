package scenarios

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// agentDriver runs the project's reservation engine in the guest through
// its operator commands, `vco-agent fence ...`, with every lab node named
// so that refusals say which node holds the disk.
type agentDriver struct {
	nodes []*lab.Guest
}

func (agentDriver) Name() string { return "vco-agent" }

func (agentDriver) NamesNodes() bool { return true }

func (agentDriver) Key(g *lab.Guest) string {
	k, err := fence.KeyFromUUID(g.UUID)
	if err != nil {
		panic(fmt.Sprintf("lab node %s has UUID %q that yields no key: %v", g.Name, g.UUID, err))
	}
	return k.String()
}

// fenceReply is the JSON `vco-agent fence ... --json` prints.
type fenceReply struct {
	OK           bool   `json:"ok"`
	Error        string `json:"error"`
	Refused      bool   `json:"refused"`
	Lost         bool   `json:"lost"`
	NotSupported bool   `json:"not_supported"`
	Holder       string `json:"holder"`
	HolderNode   string `json:"holder_node"`
	Claim        *struct {
		Key       string   `json:"key"`
		Preempted []string `json:"preempted"`
	} `json:"claim"`
	Status *struct {
		Support struct {
			Method string `json:"method"`
			Reason string `json:"reason"`
		} `json:"support"`
	} `json:"status"`
}

func (d agentDriver) run(ctx context.Context, g *lab.Guest, argv ...string) (*fenceReply, int, string, error) {
	full := append([]string{"/bin/vco-agent", "fence"}, argv...)
	full = append(full, "--json")
	for _, n := range d.nodes {
		full = append(full, "--node", n.Name+"="+n.UUID)
	}
	r, err := g.Exec().Run(ctx, 0, full...)
	if err != nil {
		return nil, 0, "", err
	}
	out := r.Stdout + r.Stderr
	var rep fenceReply
	if err := json.Unmarshal([]byte(r.Stdout), &rep); err != nil {
		return nil, r.Exit, out, fmt.Errorf("%s: %s: output is not the JSON reply: %v\n%s", g.Name, strings.Join(full, " "), err, out)
	}
	return &rep, r.Exit, out, nil
}

func (d agentDriver) Probe(ctx context.Context, g *lab.Guest, dev string) (bool, string, error) {
	rep, code, out, err := d.run(ctx, g, "show", dev)
	if err != nil {
		return false, "", err
	}
	switch {
	case code == 0 && rep.Status != nil:
		return rep.Status.Support.Method == string(fence.MethodPR), out, nil
	case code == 1 && rep.NotSupported:
		return false, out, nil
	}
	return false, out, fmt.Errorf("%s: fence show %s failed: %s", g.Name, dev, out)
}

func (d agentDriver) Acquire(ctx context.Context, g *lab.Guest, dev string, grant ...string) (outcome, error) {
	argv := []string{"acquire", dev}
	if len(grant) > 0 {
		gr := map[string]any{"disk": "lab-disk", "node": g.UUID, "supersedes": grant}
		b, _ := json.Marshal(gr)
		argv = append(argv, "--grant", string(b))
	}
	rep, code, out, err := d.run(ctx, g, argv...)
	if err != nil {
		return outcome{}, err
	}
	o := outcome{Output: out}
	switch {
	case code == 0 && rep.OK && rep.Claim != nil:
		o.Won, o.Holder, o.HolderNode, o.Preempted = true, rep.Claim.Key, g.Name, rep.Claim.Preempted
	case code == 1 && rep.Refused:
		o.Holder, o.HolderNode = rep.Holder, rep.HolderNode
	default:
		return o, fmt.Errorf("%s: fence acquire %s failed (exit %d): %s", g.Name, dev, code, out)
	}
	return o, nil
}

func (d agentDriver) Release(ctx context.Context, g *lab.Guest, dev string) error {
	_, code, out, err := d.run(ctx, g, "release", dev)
	if err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("%s: fence release %s failed (exit %d): %s", g.Name, dev, code, out)
	}
	return nil
}

func (d agentDriver) Check(ctx context.Context, g *lab.Guest, dev string) (bool, string, error) {
	rep, code, out, err := d.run(ctx, g, "check", dev)
	if err != nil {
		return false, "", err
	}
	switch {
	case code == 0 && rep.OK:
		return true, out, nil
	case code == 1 && rep.Lost:
		return false, out, nil
	}
	return false, out, fmt.Errorf("%s: fence check %s failed (exit %d): %s", g.Name, dev, code, out)
}
