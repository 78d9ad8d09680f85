package main

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
	"github.com/whitesky-cloud/vco-storage/agent/daemon"
)

// printStatus prints the agent's status, and the location it answers
// with (asked of c within ctx), as a table.
func printStatus(ctx context.Context, c *client.Client, socket string, st *api.Status) {
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	origin := "created by the agent"
	if st.SocketActivated {
		origin = "socket-activated by systemd"
	}
	dbusState := "not connected"
	if st.DbusConnected {
		dbusState = "connected"
	}
	fmt.Fprintf(tw, "Agent version:\t%s\n", st.AgentVersion)
	fmt.Fprintf(tw, "Node name:\t%s\n", st.NodeName)
	if id, err := c.GetIdentity(ctx, &api.GetIdentityRequest{}); err != nil {
		fmt.Fprintf(tw, "Location:\tnot known: %v\n", apiError(socket, err))
	} else {
		msg, bad := daemon.LocationProblem(id.Location)
		state := "ok"
		if bad {
			state = "NOT READY"
		}
		loc := id.Location
		if loc == "" {
			loc = "-"
		}
		fmt.Fprintf(tw, "Location:\t%s (%s: %s)\n", loc, state, msg)
	}
	fmt.Fprintf(tw, "Started:\t%s (up %s)\n", st.StartedAt.AsTime().Local().Format(time.RFC3339), st.Uptime.AsDuration().Round(time.Second))
	fmt.Fprintf(tw, "Socket:\t%s (%s)\n", st.SocketPath, origin)
	fmt.Fprintf(tw, "D-Bus signals:\t%s (%s)\n", dbusState, st.DbusDetail)
	fmt.Fprintf(tw, "Events published:\t%d\n", st.EventsPublished)
	fmt.Fprintf(tw, "Recent events held:\t%d of %d\n", st.EventsRecent, st.EventsRingCapacity)
	fmt.Fprintf(tw, "Event subscribers:\t%d (%d events dropped for slow ones)\n", st.Subscribers, st.EventsDropped)
	if w := st.HostWatchdog; w != nil {
		fmt.Fprintf(tw, "Host watchdog:\t%s\n", watchdogLine(w))
		if w.LastFeed != nil {
			fmt.Fprintf(tw, "Host watchdog fed:\t%s (%s ago)\n", w.LastFeed.AsTime().Local().Format(time.RFC3339), time.Since(w.LastFeed.AsTime()).Round(time.Millisecond))
		}
		if len(w.Withheld) > 0 {
			fmt.Fprintf(tw, "Host watchdog NOT fed for:\t%s\n", strings.Join(w.Withheld, "; "))
		}
		if w.Error != "" {
			fmt.Fprintf(tw, "Host watchdog error:\t%s\n", w.Error)
		}
	}
	tw.Flush()
}

func runStatus(args []string) int {
	f := newClientFlags("status", "Prints the running agent's health and counters.")
	return ask(f, args, 10*time.Second, func(ctx context.Context, c *client.Client) (*api.Status, error) {
		return c.GetStatus(ctx, &api.GetStatusRequest{})
	}, func(ctx context.Context, c *client.Client, st *api.Status) { printStatus(ctx, c, f.socket, st) })
}

// watchdogLine says in one line whether the host watchdog guards the
// leases, on which device and with what timeout.
func watchdogLine(w *api.HostWatchdog) string {
	switch {
	case w.Unsafe:
		return fmt.Sprintf("UNSAFE: none, by volumes.lease.watchdog_device: none-unsafe (%d leases held without one)", w.Leases)
	case !w.Armed:
		return fmt.Sprintf("not armed (%d leases held; armed while one is)", w.Leases)
	}
	s := fmt.Sprintf("armed: %s (%s), timeout %s, guarding %d leases", w.Device, w.Identity, w.Timeout.AsDuration(), w.Leases)
	if w.Nowayout {
		s += "; nowayout: it cannot be stopped, and is fed while the agent runs"
	}
	return s
}
