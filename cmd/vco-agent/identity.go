package main

import (
	"context"
	"flag"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/agent/config"
	"github.com/whitesky-cloud/vco-storage/agent/fencecaps"
	"github.com/whitesky-cloud/vco-storage/smbios"
)

const identitySummary = `Prints this node's identity. Asks the running agent; when it cannot be
reached, reads SMBIOS and the agent's configuration itself, and says so.`

func runIdentity(args []string) int {
	f := newClientFlags("identity", identitySummary)
	cfgPath := f.fs.String("config", config.DefaultPath, "agent configuration, for the node name and location when reading locally")
	sysfs := f.fs.String("sysfs-root", "", "sysfs root when reading locally (default: from the configuration, else /sys)")
	if code := f.parse(args); code >= 0 {
		return code
	}
	a, err := askIdentity(f, *cfgPath, *sysfs)
	if err != nil {
		return fail("identity", err)
	}
	if f.json {
		out := map[string]any{"answered_by": a.source, "socket": f.socket, "identity": protoJSON(a.id)}
		if a.whyHere != "" {
			out["agent_unreachable"] = a.whyHere
		}
		printJSON(out)
		return 0
	}
	if a.source == "agent" {
		fmt.Fprintf(stdout, "Answered by the running agent at %s.\n\n", f.socket)
	} else {
		fmt.Fprintf(stdout, "Read locally from SMBIOS and the configuration: the agent could not be asked (%s).\n\n", a.whyHere)
	}
	showIdentity(a.id)
	return 0
}

// identityAnswer is the node's identity and who gave it: the running
// agent, or this command reading it locally because the agent could not
// be asked (whyHere says why).
type identityAnswer struct {
	id              *api.Identity
	source, whyHere string
}

// askIdentity asks the running agent for the node's identity, and reads
// it locally when the agent cannot be reached.
func askIdentity(f *clientFlags, cfgPath, sysfs string) (identityAnswer, error) {
	c, err := client.Dial(f.socket)
	if err != nil {
		a := identityAnswer{source: "local", whyHere: err.Error()}
		if a.id, err = localIdentity(cfgPath, flagGiven(f, "config"), sysfs); err != nil {
			return a, fmt.Errorf("%s; reading it locally failed too: %w", a.whyHere, err)
		}
		return a, nil
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	id, err := c.GetIdentity(ctx, &api.GetIdentityRequest{})
	if err != nil {
		return identityAnswer{}, apiError(f.socket, err)
	}
	return identityAnswer{id: id, source: "agent"}, nil
}

// showIdentity prints the identity as a table.
func showIdentity(id *api.Identity) {
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	row := func(k, v string) {
		if v == "" {
			v = "-"
		}
		fmt.Fprintf(tw, "%s:\t%s\n", k, v)
	}
	row("System UUID", id.SystemUuid)
	row("Identity source", id.IdentitySource)
	row("SMBIOS version", id.SmbiosVersion)
	row("Manufacturer", id.Manufacturer)
	row("Product", id.ProductName)
	row("Serial", id.Serial)
	row("Node name", id.NodeName)
	row("Location", id.Location)
	row("Agent version", id.AgentVersion)
	for i, fc := range id.Fencing {
		k := ""
		if i == 0 {
			k = "Fencing"
		}
		state := "not available"
		if fc.Available {
			state = "available"
		}
		fmt.Fprintf(tw, "%s\t%s: %s (%s)\n", colon(k), fencingName(fc.Method), state, fc.Detail)
	}
	tw.Flush()
}

func colon(k string) string {
	if k == "" {
		return ""
	}
	return k + ":"
}

func flagGiven(f *clientFlags, name string) bool {
	given := false
	f.fs.Visit(func(fl *flag.Flag) {
		if fl.Name == name {
			given = true
		}
	})
	return given
}

func localIdentity(cfgPath string, explicit bool, sysfs string) (*api.Identity, error) {
	cfg, err := config.Load(cfgPath, explicit)
	if err != nil {
		return nil, err
	}
	if sysfs != "" {
		cfg.SysfsRoot = sysfs
	}
	info, err := smbios.Read(cfg.SysfsRoot)
	if err != nil {
		return nil, err
	}
	id := &api.Identity{
		SystemUuid: info.UUID, Manufacturer: info.Manufacturer, ProductName: info.ProductName,
		Serial: info.Serial, SmbiosVersion: info.SMBIOSVersion, IdentitySource: info.Source,
		NodeName: cfg.Node.Name, Location: cfg.Node.Location, AgentVersion: version,
	}
	for _, c := range fencecaps.Detect(cfg.SysfsRoot) {
		id.Fencing = append(id.Fencing, &api.FencingCapability{Method: api.FencingOf(c.Method), Available: c.Available, Detail: c.Detail})
	}
	return id, nil
}
