package uevent

import "testing"

// FuzzParse: no input panics the parser, and an accepted event is
// consistent with its own environment.
func FuzzParse(f *testing.F) {
	f.Add(encodeKernel(diskAdd))
	f.Add(encodeUdev(diskAdd))
	f.Fuzz(func(t *testing.T, b []byte) {
		ev, err := Parse(b)
		if err != nil {
			return
		}
		if ev.Action == "" || ev.Action != ev.Env["ACTION"] || ev.DevPath != ev.Env["DEVPATH"] || ev.DevPath[0] != '/' {
			t.Fatalf("inconsistent event %+v", ev)
		}
		if _, ok := ev.Env["MAJOR"]; ok != ev.HasDevnum {
			t.Fatalf("device number %+v", ev)
		}
	})
}
