// Package dbussignal publishes the agent's events as D-Bus signals, so that
// desktop-less tooling on the host (monitoring agents, busctl, dbus-monitor)
// sees refused and fenced disks without parsing logs. The agent owns a
// well-known name on the system bus and one object that emits one signal
// per event type and answers Introspect.
package dbussignal

import (
	"context"
	"fmt"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"

	"github.com/whitesky-cloud/vco-storage/agent/events"
)

const (
	// BusName is the agent's well-known name. Only root may own it (see the
	// policy file agent/dbus/cloud.whitesky.VcoAgent1.conf).
	BusName = "cloud.whitesky.VcoAgent1"
	// ObjectPath is the object that emits the signals.
	ObjectPath = dbus.ObjectPath("/cloud/whitesky/VcoAgent1")
	// Interface holds one signal per event type.
	Interface = "cloud.whitesky.VcoAgent1.Events"
)

// signalArgs is every signal's argument list, in order. All event types
// share it so that one consumer parses every signal the same way.
var signalArgs = []introspect.Arg{
	{Name: "sequence", Type: "t"},
	{Name: "time_usec", Type: "x"},
	{Name: "volume", Type: "s"},
	{Name: "device", Type: "s"},
	{Name: "serial", Type: "s"},
	{Name: "holder_key", Type: "s"},
	{Name: "holder_node", Type: "s"},
	{Name: "reason", Type: "s"},
	{Name: "message", Type: "s"},
}

// Node is the introspection data of ObjectPath.
func Node() *introspect.Node {
	iface := introspect.Interface{Name: Interface}
	for _, t := range events.Types {
		iface.Signals = append(iface.Signals, introspect.Signal{Name: t.String(), Args: signalArgs})
	}
	return &introspect.Node{
		Name:       string(ObjectPath),
		Interfaces: []introspect.Interface{introspect.IntrospectData, iface},
	}
}

// Sink emits events on one bus connection.
type Sink struct {
	conn *dbus.Conn
	// OwnsName is false when the bus refused BusName (another owner, or a
	// policy that does not let this user own it); signals still go out
	// from the connection's unique name.
	OwnsName bool
	// Address is the bus the sink is connected to, for status output.
	Address string
}

// Connect joins the bus at address (empty: the system bus), asks for
// BusName and exports the introspectable object.
func Connect(ctx context.Context, address string) (*Sink, error) {
	shown := address
	if address == "" {
		shown = "the system bus"
	}
	type result struct {
		conn *dbus.Conn
		err  error
	}
	done := make(chan result, 1)
	// The connection must outlive ctx (godbus closes a connection whose
	// context ends), so the timeout is applied around the dial instead.
	go func() {
		var r result
		if address == "" {
			r.conn, r.err = dbus.ConnectSystemBus()
		} else {
			r.conn, r.err = dbus.Connect(address)
		}
		done <- r
	}()
	timeout := time.NewTimer(5 * time.Second)
	defer timeout.Stop()
	var conn *dbus.Conn
	select {
	case r := <-done:
		if r.err != nil {
			return nil, fmt.Errorf("connecting to %s: %w", shown, r.err)
		}
		conn = r.conn
	case <-timeout.C:
		go func() {
			if r := <-done; r.conn != nil {
				r.conn.Close()
			}
		}()
		return nil, fmt.Errorf("connecting to %s: no answer within 5s", shown)
	case <-ctx.Done():
		go func() {
			if r := <-done; r.conn != nil {
				r.conn.Close()
			}
		}()
		return nil, fmt.Errorf("connecting to %s: %w", shown, ctx.Err())
	}
	s := &Sink{conn: conn, Address: shown}
	if err := conn.Export(introspect.NewIntrospectable(Node()), ObjectPath, "org.freedesktop.DBus.Introspectable"); err != nil {
		conn.Close()
		return nil, fmt.Errorf("exporting %s on %s: %w", ObjectPath, shown, err)
	}
	reply, err := conn.RequestName(BusName, dbus.NameFlagDoNotQueue)
	if err == nil && (reply == dbus.RequestNameReplyPrimaryOwner || reply == dbus.RequestNameReplyAlreadyOwner) {
		s.OwnsName = true
	}
	return s, nil
}

// Name is the sink's name in log lines.
func (s *Sink) Name() string { return "dbus" }

// Emit sends the event as the signal named after its type.
func (s *Sink) Emit(e events.Event) error {
	return s.conn.Emit(ObjectPath, Interface+"."+e.Type.String(),
		e.Seq, e.Time.UnixMicro(), e.Volume, e.Device, e.Serial,
		e.HolderKeyString(), e.HolderNode, e.Reason, e.Message)
}

// Close releases the name and leaves the bus.
func (s *Sink) Close() error {
	if s.OwnsName {
		_, _ = s.conn.ReleaseName(BusName)
	}
	return s.conn.Close()
}

// Decode turns a received signal back into an event; the CLI and tests use
// it, and it is the one place that knows the argument order besides Emit.
func Decode(sig *dbus.Signal) (events.Event, error) {
	const prefix = Interface + "."
	if len(sig.Name) <= len(prefix) || sig.Name[:len(prefix)] != prefix {
		return events.Event{}, fmt.Errorf("signal %s is not from interface %s", sig.Name, Interface)
	}
	t, ok := events.ParseType(sig.Name[len(prefix):])
	if !ok {
		return events.Event{}, fmt.Errorf("unknown event signal %s", sig.Name)
	}
	var e events.Event
	var usec int64
	var key string
	if err := dbus.Store(sig.Body, &e.Seq, &usec, &e.Volume, &e.Device, &e.Serial, &key, &e.HolderNode, &e.Reason, &e.Message); err != nil {
		return events.Event{}, fmt.Errorf("signal %s: %w", sig.Name, err)
	}
	e.Type = t
	e.Time = time.UnixMicro(usec)
	if key != "" {
		if _, err := fmt.Sscanf(key, "%016x", &e.HolderKey); err != nil {
			return events.Event{}, fmt.Errorf("signal %s: holder key %q: %w", sig.Name, key, err)
		}
	}
	return e, nil
}
