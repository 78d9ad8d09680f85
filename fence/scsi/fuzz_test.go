package scsi

import (
	"testing"
)

// The fuzz targets check that no input panics and that what the parsers
// return is consistent with the input; their seed corpora live in
// testdata/fuzz/<FuzzName>.

func FuzzParseSense(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseSense(b)
		if err != nil {
			return
		}
		if s.ResponseCode < 0x70 || s.ResponseCode > 0x73 {
			t.Fatalf("accepted response code %#x", s.ResponseCode)
		}
		if s.Key > 0xf {
			t.Fatalf("sense key %#x", s.Key)
		}
		_ = s.String()
	})
}

func FuzzParseReadKeys(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		k, err := ParseReadKeys(b)
		if err != nil {
			return
		}
		if 8+8*len(k.Keys) > len(b) {
			t.Fatalf("%d keys from %d bytes", len(k.Keys), len(b))
		}
		if !k.Truncated && 8+8*len(k.Keys) != k.Need {
			t.Fatalf("not truncated but %d keys for need %d", len(k.Keys), k.Need)
		}
	})
}

func FuzzParseReadReservation(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseReadReservation(b)
		if err != nil {
			return
		}
		if r.Present && len(b) < 24 {
			t.Fatalf("reservation from %d bytes", len(b))
		}
		if r.Type > 0xf || r.Scope > 0xf {
			t.Fatalf("type %d scope %d", r.Type, r.Scope)
		}
	})
}

func FuzzParseReportCapabilities(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseReportCapabilities(b)
		if err != nil {
			return
		}
		for _, ty := range c.Types() {
			if !c.TypeMaskValid || !c.Supports(ty) {
				t.Fatalf("type %d listed but not supported", ty)
			}
		}
	})
}

func FuzzParseReadFullStatus(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		fs, err := ParseReadFullStatus(b)
		if err != nil {
			return
		}
		n := 8
		for _, r := range fs.Registrants {
			n += 24 + len(r.TransportID)
			_ = r.Initiator()
		}
		if n > len(b) {
			t.Fatalf("descriptors cover %d bytes of %d", n, len(b))
		}
	})
}

func FuzzParseInquiry(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		q, err := ParseInquiry(b)
		if err != nil {
			return
		}
		for _, s := range []string{q.Vendor, q.Product, q.Revision} {
			for _, c := range []byte(s) {
				if c < 0x20 || c >= 0x7f {
					t.Fatalf("control byte %#x in %q", c, s)
				}
			}
		}
	})
}

func FuzzParseUnitSerial(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseUnitSerial(b)
		if err != nil {
			return
		}
		if len(s) > len(b) {
			t.Fatalf("serial %q longer than the page", s)
		}
	})
}

func FuzzParseDeviceID(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		ds, err := ParseDeviceID(b)
		n := 4
		for _, d := range ds {
			n += 4 + len(d.Value)
			if d.Association > 3 || d.Type > 0xf {
				t.Fatalf("designator %+v", d)
			}
		}
		if len(ds) > 0 && n > len(b) {
			t.Fatalf("designators cover %d bytes of %d (err %v)", n, len(b), err)
		}
		_ = LUNames(ds)
	})
}
