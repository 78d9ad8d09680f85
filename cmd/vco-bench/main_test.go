package main

import (
	"strings"
	"testing"
)

// Lines as the bench-* targets write them.
const sample = `goos: linux
BenchmarkExecToReady/vs=bin-true-2         	      10	         0 ns/op	        12.5 ms	         1.1 ref-ms	        11.36 x-ref	 71.68 %dropped
BenchmarkCreatePublish100-2   	       5	 812345678 ns/op	       120.0 api-req/vol	       400.0 drv-ms/batch	       390.0 ref-ms/batch	         1.026 drv/ref
BenchmarkNoReference-2   	       5	 100 ns/op
PASS
benchmark                                             value    ratio
guest boot, alone (reference)                         8.10s    1.00x
lab set-up, 1 guest                                   9.00s    1.11x
PR acquire+release, sg_persist (reference)            40.0ms    1.00x
PR acquire+release, vco-agent fence                   20.0ms    0.50x
`

func TestParse(t *testing.T) {
	rows, failed := parse(strings.NewReader(sample), "x")
	if failed {
		t.Fatal("reported a failure in passing output")
	}
	want := []row{
		{"agent exec to READY=1", "12.5 ms", "exec to exit of /bin/true", "1.1 ms", "11.36x", "x", "71.68 %dropped"},
		{"100 concurrent CreateVolume+ControllerPublish, API round trip 30 ms", "400.0 ms/batch", "the same API calls made bare", "390.0 ms/batch", "1.026x", "x", "120.0 api-req/vol"},
		{"lab set-up, 1 guest", "9.00s", "guest boot, alone", "8.10s", "1.11x", "x", ""},
		{"PR acquire+release, vco-agent fence", "20.0ms", "PR acquire+release, sg_persist", "40.0ms", "0.50x", "x", ""},
	}
	if len(rows) != len(want) {
		t.Fatalf("got %d rows, want %d: %+v", len(rows), len(want), rows)
	}
	for i := range want {
		if rows[i] != want[i] {
			t.Errorf("row %d: got %+v, want %+v", i, rows[i], want[i])
		}
	}
}

func TestParseFailure(t *testing.T) {
	_, failed := parse(strings.NewReader("--- FAIL: BenchmarkX\nFAIL\n"), "x")
	if !failed {
		t.Fatal("a failed benchmark was not reported")
	}
}
