package location

import "testing"

func TestCheck(t *testing.T) {
	for _, v := range []string{"ch-lug-1", "nl-ams-1", "be-g8-3"} {
		if err := Check(v); err != nil {
			t.Errorf("Check(%q) = %v, want nil", v, err)
		}
	}
	for _, v := range []string{Placeholder, "replace-with-location", "REPLACE_WITH_LOC", "${LOCATION}", "$LOCATION",
		"{{ .Location }}", "<location>", "CHANGEME", "ch lug 1", "-ch", "a/b"} {
		if err := Check(v); err == nil {
			t.Errorf("Check(%q) = nil, want a refusal", v)
		}
	}
}
