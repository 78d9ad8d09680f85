package fence

import (
	"errors"
	"strings"
	"testing"
)

func TestKeyFromUUID(t *testing.T) {
	// Expected values: prefix 7663, then the first six bytes of
	// `printf %s <uuid> | sha256sum`, computed outside Go.
	for _, tc := range []struct {
		in   string
		want Key
	}{
		{"4c4c4544-0042-3610-8052-b4c04f4e3332", 0x76638f635b9108ec},
		{"4C4C4544-0042-3610-8052-B4C04F4E3332", 0x76638f635b9108ec},
		{"{4c4c4544-0042-3610-8052-b4c04f4e3332}", 0x76638f635b9108ec},
		{"urn:uuid:4c4c4544-0042-3610-8052-b4c04f4e3332\n", 0x76638f635b9108ec},
		{"8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab", 0x7663049fd5118d50},
	} {
		k, err := KeyFromUUID(tc.in)
		if err != nil {
			t.Fatalf("%q: %v", tc.in, err)
		}
		if k != tc.want {
			t.Errorf("KeyFromUUID(%q) = %s, want %s", tc.in, k, tc.want)
		}
		if !k.Ours() || k == 0 {
			t.Errorf("%s lacks the prefix", k)
		}
	}
	for _, bad := range []string{"", "4c4c4544004236108052b4c04f4e3332", "4c4c4544-0042-3610-8052-b4c04f4e333", "zc4c4544-0042-3610-8052-b4c04f4e3332",
		"00000000-0000-0000-0000-000000000000", "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF"} {
		if k, err := KeyFromUUID(bad); err == nil {
			t.Errorf("KeyFromUUID(%q) = %s, want an error", bad, k)
		}
	}
}

func TestParseKey(t *testing.T) {
	for in, want := range map[string]Key{"0x76638f635b9108ec": 0x76638f635b9108ec, "76638F635B9108EC": 0x76638f635b9108ec, "0x1": 1} {
		if k, err := ParseKey(in); err != nil || k != want {
			t.Errorf("ParseKey(%q) = %s, %v", in, k, err)
		}
	}
	for _, bad := range []string{"0", "0x0", "", "0x", "0x1234567890abcdef0", "key"} {
		if _, err := ParseKey(bad); err == nil {
			t.Errorf("ParseKey(%q) accepted", bad)
		}
	}
	if s := Key(0x76638f635b9108ec).String(); s != "0x76638f635b9108ec" {
		t.Errorf("String() = %s", s)
	}
}

func TestGrantRoundTripAndChecks(t *testing.T) {
	g, err := ParseGrant(`{"disk":"disk-7","node":"8F2D6A1E-9B3C-4D5E-A6F7-0123456789AB","supersedes":["0x76638f635b9108ec"]}`)
	if err != nil {
		t.Fatal(err)
	}
	if g.Node != "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab" || !g.Names(0x76638f635b9108ec) || g.Names(1) {
		t.Fatalf("grant %+v", g)
	}
	g2, err := ParseGrant(g.Encode())
	if err != nil || g2.Encode() != g.Encode() {
		t.Fatalf("round trip: %v, %s vs %s", err, g2.Encode(), g.Encode())
	}
	if err := g.ForNode("8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab", "disk-7"); err != nil {
		t.Fatal(err)
	}
	if err := g.ForNode("8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab", ""); err != nil {
		t.Fatal(err)
	}
	if err := g.ForNode("4c4c4544-0042-3610-8052-b4c04f4e3332", "disk-7"); err == nil || !strings.Contains(err.Error(), "not this node") {
		t.Fatalf("other node: %v", err)
	}
	if err := g.ForNode("8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab", "disk-8"); err == nil {
		t.Fatal("other disk accepted")
	}
	var nilGrant *Grant
	if nilGrant.Names(0x76638f635b9108ec) {
		t.Fatal("nil grant names a key")
	}
	for _, bad := range []string{
		``, `{}`, `{"disk":"d","node":"8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab","supersedes":[]}`,
		`{"disk":"d","node":"x","supersedes":["0x1"]}`,
		`{"disk":"d","node":"8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab","supersedes":["0x0"]}`,
		`{"disk":"d","node":"8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab","supersedes":["0x1"],"extra":1}`,
		`{"disk":"d","node":"8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab","supersedes":["0x1"]} {}`,
	} {
		if _, err := ParseGrant(bad); err == nil {
			t.Errorf("ParseGrant(%q) accepted", bad)
		}
	}
}

func TestNewGrant(t *testing.T) {
	g, err := NewGrant("disk-7", "8F2D6A1E-9B3C-4D5E-A6F7-0123456789AB", []string{"76638f635b9108ec", "0x7663000000000001"})
	if err != nil {
		t.Fatal(err)
	}
	want, err := ParseGrant(`{"disk":"disk-7","node":"8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab","supersedes":["0x76638f635b9108ec","0x7663000000000001"]}`)
	if err != nil || g.Encode() != want.Encode() {
		t.Fatalf("NewGrant: %s, ParseGrant: %s (%v)", g.Encode(), want.Encode(), err)
	}
	const node = "8f2d6a1e-9b3c-4d5e-a6f7-0123456789ab"
	for _, c := range []struct {
		disk, node string
		keys       []string
		want       string
	}{
		{"", node, []string{"0x1"}, "names no disk"},
		{"d", "x", []string{"0x1"}, "8-4-4-4-12"},
		{"d", "00000000-0000-0000-0000-000000000000", []string{"0x1"}, "not set"},
		{"d", node, nil, "names no superseded key"},
		{"d", node, []string{"0x1", "0x0"}, "zero"},
		{"d", node, []string{"key"}, "hexadecimal"},
	} {
		if g, err := NewGrant(c.disk, c.node, c.keys); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewGrant(%q, %q, %q) = %+v, %v; want an error saying %q", c.disk, c.node, c.keys, g, err, c.want)
		}
	}
}

func TestErrorsNameTheHolder(t *testing.T) {
	he := &HeldError{Device: "/dev/sdb", Holder: 0x76638f635b9108ec, HolderNode: "worker-1", Type: WriteExclusive}
	for _, want := range []string{"/dev/sdb", "0x76638f635b9108ec", "worker-1", "Write Exclusive", "grant"} {
		if !strings.Contains(he.Error(), want) {
			t.Errorf("%q lacks %q", he.Error(), want)
		}
	}
	he.HolderNode = ""
	if !strings.Contains(he.Error(), "node unknown") {
		t.Errorf("%q", he.Error())
	}
	le := &LostError{Device: "/dev/sdb", Reason: "key preempted", Holder: 0x7663049fd5118d50, HolderNode: "worker-2"}
	for _, want := range []string{"/dev/sdb", "key preempted", "0x7663049fd5118d50", "worker-2", "not re-claimed"} {
		if !strings.Contains(le.Error(), want) {
			t.Errorf("%q lacks %q", le.Error(), want)
		}
	}
	var target *HeldError
	if !errors.As(error(he), &target) {
		t.Fatal("errors.As")
	}
}

func TestDirectory(t *testing.T) {
	d, err := NewDirectory(map[string]string{"worker-1": "4c4c4544-0042-3610-8052-b4c04f4e3332"})
	if err != nil {
		t.Fatal(err)
	}
	if n, ok := d.NodeForKey(0x76638f635b9108ec); !ok || n != "worker-1" {
		t.Fatalf("NodeForKey = %q, %v", n, ok)
	}
	if _, ok := d.NodeForKey(1); ok {
		t.Fatal("unknown key resolved")
	}
	if _, err := NewDirectory(map[string]string{"x": "nope"}); err == nil {
		t.Fatal("bad uuid accepted")
	}
}

func FuzzParseGrant(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		g, err := ParseGrant(s)
		if err != nil {
			return
		}
		if g.Disk == "" || len(g.Supersedes) == 0 {
			t.Fatalf("accepted incomplete grant %+v", g)
		}
		for _, k := range g.Supersedes {
			if k == 0 {
				t.Fatal("zero key accepted")
			}
		}
		g2, err := ParseGrant(g.Encode())
		if err != nil || g2.Encode() != g.Encode() {
			t.Fatalf("re-encoding %q: %v", g.Encode(), err)
		}
	})
}

func FuzzParseKey(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		k, err := ParseKey(s)
		if err != nil {
			return
		}
		if k == 0 {
			t.Fatal("zero key")
		}
		if k2, err := ParseKey(k.String()); err != nil || k2 != k {
			t.Fatalf("round trip of %s: %s, %v", k, k2, err)
		}
	})
}
