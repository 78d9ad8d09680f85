package discovery

import "testing"

func FuzzParseLocator(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		l, err := ParseLocator(s)
		if err != nil {
			return
		}
		if l.PCI == nil && l.Serial == "" && l.WWN == "" {
			t.Fatal("empty locator accepted")
		}
		// Serials and WWNs containing commas or '=' cannot round-trip; the
		// rest must.
		if l2, err := ParseLocator(l.String()); err == nil && l2.String() != l.String() {
			t.Fatalf("%q -> %q -> %q", s, l.String(), l2.String())
		}
		// What Check admits has a text form that reads back the same.
		if l.Check() == nil {
			b, err := l.MarshalText()
			var back Locator
			if err != nil || back.UnmarshalText(b) != nil || !back.Equal(l) {
				t.Fatalf("%q -> %+v -> %q -> %+v (%v)", s, l, b, back, err)
			}
		}
	})
}

func FuzzParsePCIAddress(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		a, err := ParsePCIAddress(s)
		if err != nil {
			return
		}
		if a.Slot > 0x1f || a.Function > 7 {
			t.Fatalf("%q -> %+v", s, a)
		}
		b, err := ParsePCIAddress(a.String())
		if err != nil || b != a {
			t.Fatalf("%q -> %s -> %+v, %v", s, a, b, err)
		}
	})
}

func FuzzParseDevnum(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		ma, mi, err := parseDevnum(s)
		if err != nil {
			return
		}
		if a, b, err := parseDevnum(fmtDevnum(ma, mi)); err != nil || a != ma || b != mi {
			t.Fatalf("%q -> %d:%d", s, ma, mi)
		}
	})
}
