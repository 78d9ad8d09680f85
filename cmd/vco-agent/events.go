package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/api"
	"github.com/whitesky-cloud/vco-storage/agent/client"
)

func runEvents(args []string) int {
	f := newClientFlags("events", "Prints the agent's recent events; with --follow, keeps printing new ones.")
	follow := f.fs.Bool("follow", false, "after the recent events, print new ones as they happen until interrupted")
	if code := f.parse(args); code >= 0 {
		return code
	}
	c, err := client.Dial(f.socket)
	if err != nil {
		return fail("events", err)
	}
	defer c.Close()
	if !*follow {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		r, err := c.ListRecentEvents(ctx, &api.ListRecentEventsRequest{})
		if err != nil {
			return fail("events", apiError(f.socket, err))
		}
		for _, e := range r.Events {
			printEvent(e, f.json)
		}
		return 0
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	stream, err := c.WatchEvents(ctx, &api.WatchEventsRequest{ReplayRecent: true})
	if err != nil {
		return fail("events", apiError(f.socket, err))
	}
	for {
		e, err := stream.Recv()
		switch {
		case err == nil:
			printEvent(e, f.json)
			if fl, ok := stdout.(*os.File); ok {
				_ = fl.Sync()
			}
		case errors.Is(err, io.EOF):
			fmt.Fprintln(stderr, "vco-agent events: the agent ended the stream (it is stopping)")
			return 0
		case ctx.Err() != nil:
			return 0
		default:
			return fail("events", fmt.Errorf("the event stream from %s broke: %w", f.socket, err))
		}
	}
}

func printEvent(e *api.Event, asJSON bool) {
	if asJSON {
		fmt.Fprintln(stdout, string(protoJSON(e)))
		return
	}
	if e.MissedBefore > 0 {
		fmt.Fprintf(stdout, "(%d events missed here: this reader fell behind the agent)\n", e.MissedBefore)
	}
	var b strings.Builder
	name := eventName(e.Type)
	fmt.Fprintf(&b, "%s #%d %s", e.Time.AsTime().Local().Format(time.RFC3339), e.Sequence, name)
	for _, kv := range [][2]string{{"volume", e.Volume}, {"device", e.Device}, {"serial", e.Serial},
		{"holder_key", e.HolderKey}, {"holder_node", e.HolderNode}, {"reason", e.Reason}} {
		if kv[1] != "" {
			fmt.Fprintf(&b, " %s=%s", kv[0], kv[1])
		}
	}
	if e.Message != "" {
		fmt.Fprintf(&b, ": %s", e.Message)
	}
	fmt.Fprintln(stdout, b.String())
}

// eventName is the type's name as the journal and D-Bus spell it
// (EVENT_TYPE_DISK_REFUSED -> DiskRefused).
func eventName(t api.EventType) string {
	var b strings.Builder
	for _, w := range strings.Split(strings.TrimPrefix(t.String(), "EVENT_TYPE_"), "_") {
		if w != "" {
			b.WriteString(w[:1] + strings.ToLower(w[1:]))
		}
	}
	return b.String()
}
