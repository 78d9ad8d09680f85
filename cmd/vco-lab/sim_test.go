package main

import "testing"

func TestSimServesLoopbackOnly(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:0", "[::]:0", "localhost:0"} {
		if rc := runSim([]string{"--listen", addr, "--dir", t.TempDir()}); rc != 2 {
			t.Errorf("--listen %s: exit %d, want 2 (refused)", addr, rc)
		}
	}
}
