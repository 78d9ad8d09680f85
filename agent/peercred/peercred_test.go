package peercred

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
)

func TestPolicy(t *testing.T) {
	p := Policy{GID: 4242, GroupName: "vco"}
	cases := []struct {
		c    Creds
		want bool
	}{
		{Creds{UID: 0, GID: 7}, true},
		{Creds{UID: 1000, GID: 4242}, true},
		{Creds{UID: 1000, GID: 1000, Groups: []uint32{10, 4242}}, true},
		{Creds{UID: 1000, GID: 1000, Groups: []uint32{10}}, false},
		{Creds{UID: 1000, GID: 1000}, false},
	}
	for _, c := range cases {
		ok, why := p.Allows(c.c)
		if ok != c.want {
			t.Errorf("%v: allowed=%v, want %v", c.c, ok, c.want)
		}
		if !ok && !strings.Contains(why, "group vco (gid 4242)") {
			t.Errorf("refusal %q does not name the group", why)
		}
	}
	if ok, why := (Policy{GID: -1}).Allows(Creds{UID: 5, GID: 5}); ok || !strings.Contains(why, "no socket group") {
		t.Errorf("root-only policy: %v %q", ok, why)
	}
}

func TestFromConnReadsThisProcess(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := net.Dial("unix", sock)
		if err == nil {
			defer c.Close()
			buf := make([]byte, 1)
			c.Read(buf)
		}
	}()
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cr, err := FromConn(c)
	if err != nil {
		t.Fatal(err)
	}
	if int(cr.PID) != os.Getpid() || int(cr.UID) != os.Geteuid() || int(cr.GID) != os.Getegid() {
		t.Fatalf("creds %v, want this process (pid %d uid %d gid %d)", cr, os.Getpid(), os.Geteuid(), os.Getegid())
	}
	groups, _ := syscall.Getgroups()
	for _, g := range groups {
		if !slices.Contains(cr.Groups, uint32(g)) {
			t.Errorf("supplementary group %d missing from %v", g, cr.Groups)
		}
	}
}
