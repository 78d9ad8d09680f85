package volume

import (
	"strings"
	"testing"
)

// Two volumes never share a dm-crypt mapping name: escapes cannot be
// confused with bytes kept as they are, and ids cut for length keep a
// digest of the whole id. Names stay within the kernel's bound.
func TestMapperNamesNameOneVolumeEach(t *testing.T) {
	long := strings.Repeat("a", 200)
	ids := []string{
		"pvc/x", "pvc_2fx", "pvc_x", "pvc_5fx", "pvc x", "pvc_20x",
		"vol-1", "vol.1", "Vol-1", "é", "_c3_a9", "_c3a9", "中", "_e4_b8_ad",
		long, long + "b", long + "c", long[:120], long[:116], long[:117],
		strings.Repeat("/", 100), strings.Repeat("_2f", 100),
		"x_h" + strings.Repeat("0", 40),
	}
	seen := map[string]string{}
	for _, id := range ids {
		n := mapperName(id)
		if len(n) > mapperNameMax || !strings.HasPrefix(n, "vco-") {
			t.Errorf("mapperName(%q) = %q (%d bytes)", id, n, len(n))
		}
		for i := 0; i < len(n); i++ {
			c := n[i]
			if !(c == '-' || c == '.' || c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
				t.Errorf("mapperName(%q) = %q holds byte %q", id, n, c)
			}
		}
		if o, ok := seen[n]; ok {
			t.Errorf("volumes %q and %q share the mapping name %q", o, id, n)
		}
		seen[n] = id
	}
	// The names of ids of our own controller did not change.
	for id, want := range map[string]string{"vol-enc": "vco-vol-enc", "vol-rescue": "vco-vol-rescue", "pvc-0a1b.2": "vco-pvc-0a1b.2"} {
		if got := mapperName(id); got != want {
			t.Errorf("mapperName(%q) = %q, want %q", id, got, want)
		}
	}
}

// A mapping an earlier agent opened under another name is closed by the
// name its record holds; a record naming no mapping, or something that
// is not one, falls back to the volume's own name.
func TestMappingIsClosedByTheNameItsRecordHolds(t *testing.T) {
	for _, tc := range []struct{ mapper, want string }{
		{"/dev/mapper/vco-pvc_x", "vco-pvc_x"},
		{"", "vco-pvc_5fx"},
		{"/dev/mapper/", "vco-pvc_5fx"},
		{"/dev/mapper/../sda", "vco-pvc_5fx"},
		{"/dev/sda", "vco-pvc_5fx"},
	} {
		if got := mapperOf(&Claim{Volume: "pvc_x", Mapper: tc.mapper}); got != tc.want {
			t.Errorf("mapper %q: closed as %q, want %q", tc.mapper, got, tc.want)
		}
	}
}

// A name an earlier version recorded for one volume that is now another
// claimed volume's own is not closed for the first: the second's mapping
// would go. The first's own name is closed instead (its earlier mapping,
// if still open, holds its disk, and the release guard keeps the fence).
func TestALegacyMappingNameThatIsAnotherVolumesIsNotClosed(t *testing.T) {
	e := newEnv(t)
	old := &Claim{Volume: "pvc_5fx", Mapper: "/dev/mapper/vco-pvc_5fx", Phase: PhaseStaged, State: StateHeld}
	if err := e.m.Store().Put(old); err != nil {
		t.Fatal(err)
	}
	if got := e.m.mapperToClose(old); got != "vco-pvc_5fx" {
		t.Fatalf("legacy name no other volume has: closed as %q, want vco-pvc_5fx", got)
	}
	if err := e.m.Store().Put(&Claim{Volume: "pvc_x", Phase: PhaseClaiming, State: StateHeld}); err != nil {
		t.Fatal(err)
	}
	if got := e.m.mapperToClose(old); got != "vco-pvc_5f5fx" {
		t.Fatalf("legacy name that is now pvc_x's: closed as %q, want vco-pvc_5f5fx", got)
	}
}
