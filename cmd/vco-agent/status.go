package main

import (
	"context"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
)

func runStatus(args []string) int {
	f := newClientFlags("status", "Prints the running agent's health and counters.")
	if code := f.parse(args); code >= 0 {
		return code
	}
	c, err := client.Dial(f.socket)
	if err != nil {
		return fail("status", err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := c.GetStatus(ctx, &api.GetStatusRequest{})
	if err != nil {
		return fail("status", apiError(f.socket, err))
	}
	if f.json {
		fmt.Fprintln(stdout, string(protoJSON(st)))
		return 0
	}
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
	fmt.Fprintf(tw, "Started:\t%s (up %s)\n", st.StartedAt.AsTime().Local().Format(time.RFC3339), st.Uptime.AsDuration().Round(time.Second))
	fmt.Fprintf(tw, "Socket:\t%s (%s)\n", st.SocketPath, origin)
	fmt.Fprintf(tw, "D-Bus signals:\t%s (%s)\n", dbusState, st.DbusDetail)
	fmt.Fprintf(tw, "Events published:\t%d\n", st.EventsPublished)
	fmt.Fprintf(tw, "Recent events held:\t%d of %d\n", st.EventsRecent, st.EventsRingCapacity)
	fmt.Fprintf(tw, "Event subscribers:\t%d (%d events dropped for slow ones)\n", st.Subscribers, st.EventsDropped)
	tw.Flush()
	return 0
}
