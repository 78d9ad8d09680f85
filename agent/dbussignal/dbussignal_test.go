package dbussignal

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/agent/internal/testbus"
	"github.com/whitesky-cloud/vco-storage/internal/hosttest"
)

const policy = "../dbus/cloud.whitesky.VcoAgent1.conf"

// TestMain doubles as an unprivileged child that tries to own the name.
func TestMain(m *testing.M) {
	if addr := os.Getenv("VCO_DBUS_CHILD_ADDR"); addr != "" {
		// Drop to nobody before touching the bus.
		if err := syscall.Setgroups(nil); err == nil {
			_ = syscall.Setgid(65534)
			_ = syscall.Setuid(65534)
		}
		conn, err := dbus.Connect(addr)
		if err != nil {
			fmt.Println("connect:", err)
			os.Exit(0)
		}
		reply, err := conn.RequestName(BusName, dbus.NameFlagDoNotQueue)
		fmt.Printf("uid=%d reply=%d err=%v\n", os.Getuid(), reply, err)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func listen(t *testing.T, addr string) (*dbus.Conn, chan *dbus.Signal) {
	t.Helper()
	c, err := dbus.Connect(addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.AddMatchSignal(dbus.WithMatchInterface(Interface), dbus.WithMatchObjectPath(ObjectPath)); err != nil {
		t.Fatal(err)
	}
	ch := make(chan *dbus.Signal, 16)
	c.Signal(ch)
	return c, ch
}

func TestSignalArrivesWithArguments(t *testing.T) {
	addr := testbus.Start(t, policy)
	_, ch := listen(t, addr)
	s, err := Connect(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.OwnsName {
		t.Fatal("root could not own " + BusName + " under the packaged policy")
	}
	sent := events.Event{Type: events.DiskRefused, Seq: 42, Time: time.UnixMicro(1_790_000_000_123_456),
		Volume: "loc/disk-7", Device: "/dev/sdc", Serial: "SER7", HolderKey: 0x5643010203040506,
		HolderNode: "node-b", Reason: "held-elsewhere", Message: "disk 7 is held by node-b"}
	if err := s.Emit(sent); err != nil {
		t.Fatal(err)
	}
	select {
	case sig := <-ch:
		if sig.Name != Interface+".DiskRefused" || sig.Path != ObjectPath {
			t.Fatalf("signal %s on %s", sig.Name, sig.Path)
		}
		got, err := Decode(sig)
		if err != nil {
			t.Fatal(err)
		}
		if !got.Time.Equal(sent.Time) {
			t.Errorf("time %v, want %v", got.Time, sent.Time)
		}
		got.Time = sent.Time
		if got != sent {
			t.Errorf("received %+v\nwant     %+v", got, sent)
		}
		if sig.Body[5] != "5643010203040506" {
			t.Errorf("holder_key argument %v", sig.Body[5])
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no signal received")
	}
}

func TestIntrospectListsEverySignal(t *testing.T) {
	addr := testbus.Start(t, policy)
	s, err := Connect(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.OwnsName {
		t.Fatal("name not owned")
	}
	c, _ := listen(t, addr)
	node, err := introspect.Call(c.Object(BusName, ObjectPath))
	if err != nil {
		t.Fatal(err)
	}
	var iface *introspect.Interface
	for i := range node.Interfaces {
		if node.Interfaces[i].Name == Interface {
			iface = &node.Interfaces[i]
		}
	}
	if iface == nil {
		t.Fatalf("interface %s not introspected: %+v", Interface, node.Interfaces)
	}
	names := map[string][]introspect.Arg{}
	for _, sg := range iface.Signals {
		names[sg.Name] = sg.Args
	}
	for _, ty := range events.Types {
		args, ok := names[ty.String()]
		if !ok {
			t.Errorf("signal %s missing", ty)
			continue
		}
		if len(args) != 9 || args[0].Name != "sequence" || args[0].Type != "t" || args[8].Name != "message" {
			t.Errorf("signal %s args %+v", ty, args)
		}
	}
}

func TestOnlyRootOwnsTheName(t *testing.T) {
	hosttest.NeedRoot(t, "needs root to drop to another user")
	addr := testbus.Start(t, policy)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "VCO_DBUS_CHILD_ADDR="+addr)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	s := string(out)
	if !strings.Contains(s, "uid=65534") {
		t.Fatalf("child did not run as nobody: %s", s)
	}
	if strings.Contains(s, "reply=1 ") || !strings.Contains(s, "AccessDenied") && !strings.Contains(s, "not allowed") {
		t.Fatalf("an unprivileged user could own %s: %s", BusName, s)
	}
}

func TestConnectFailureNamesTheBus(t *testing.T) {
	_, err := Connect(context.Background(), "unix:path=/nonexistent/vco-bus")
	if err == nil || !strings.Contains(err.Error(), "unix:path=/nonexistent/vco-bus") {
		t.Fatalf("got %v", err)
	}
}
