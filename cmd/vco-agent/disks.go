package main

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
)

// printDisks prints the agent's list of disks as a table.
func printDisks(_ context.Context, _ *client.Client, resp *api.ListDisksResponse) {
	if len(resp.Disks) == 0 {
		fmt.Fprintln(stdout, "no disks")
		return
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "DEVICE\tKIND\tSERIAL\tFENCING\tSTATE\tVOLUME\tHOLDER\tDETAIL")
	for _, d := range resp.Disks {
		holder := "-"
		if d.HolderKey != "" {
			holder = "0x" + d.HolderKey
			if d.HolderNode != "" {
				holder += " (" + d.HolderNode + ")"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", dash(d.Device), dash(d.Kind), dash(d.Serial), fencingName(d.Fencing),
			stateName(d.State), dash(d.VolumeId), holder, dash(d.Detail))
	}
	tw.Flush()
}

func runDisks(args []string) int {
	f := newClientFlags("disks", "Lists every disk the running agent sees and every volume it has claimed,\nwith the fencing method, the claim's state and the disk's holder.")
	return ask(f, args, 30*time.Second, func(ctx context.Context, c *client.Client) (*api.ListDisksResponse, error) {
		return c.ListDisks(ctx, &api.ListDisksRequest{})
	}, printDisks)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return strings.ReplaceAll(s, "\n", " ")
}

// fencingName is how the CLI writes a fencing method: fence's name of it.
func fencingName(m api.FencingMethod) string {
	if name := m.Method(); name != "" {
		return string(name)
	}
	return "-"
}

func stateName(s api.ClaimState) string {
	if s == api.ClaimState_CLAIM_STATE_UNSPECIFIED {
		return "staging"
	}
	return strings.ToLower(strings.TrimPrefix(s.String(), "CLAIM_STATE_"))
}
