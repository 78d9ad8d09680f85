package cloud_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/cloud"
)

// answer is a transport that returns one canned answer: the fuzzer's body
// and status stand in for whatever the API, or a proxy in front of it,
// sends back.
type answer struct {
	status int
	body   []byte
}

func (a answer) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	return &http.Response{StatusCode: a.status, Header: http.Header{"Content-Type": {"application/json"}},
		Body: io.NopCloser(bytes.NewReader(a.body)), Request: r}, nil
}

// FuzzDecodeAnswers gives every decoding call of the client an arbitrary
// answer. The client must not panic, must return either a value or an
// error that wraps one of its sentinels, and must never put the
// credential (or a JWT's signature part) into the error text, even when
// the answer echoes it.
func FuzzDecodeAnswers(f *testing.F) {
	for _, s := range []struct {
		status int
		body   string
	}{
		{200, `[{"id":1,"name":"pvc-1","location":"ch-lug-1","size":10,"type":"D","status":"CREATED"}]`},
		{200, `{"disk_id":7}`},
		{200, ``},
		{200, `{"disk_id":0}`},
		{200, `"snap-1"`},
		{200, `{"result":[{"original_disk_id":7,"new_disk_id":0}]}`},
		{200, `[{"vm_id":3,"name":"w1","reference_id":"4c4c4544-0042-3610-8052-b4c04f4e3332","disks":[{"disk_id":7,"pci_bus":0,"pci_slot":7}]}]`},
		{200, `[{"title":"vco-csi/holder","content":"3"}]`},
		{200, `{"id":1,"size":1e400}`},
		{200, `[` + strings.Repeat(`{"id":1},`, 50) + `{}]`},
		{200, `<html>proxy</html>`},
		{401, `{"message":"bad token ` + jwt + `"}`},
		{403, `{"error":"no quota"}`},
		{404, ``},
		{409, `{"message":"exists"}`},
		{429, `slow down`},
		{500, strings.Repeat("x", 400)},
		{503, `{"message":"` + jwt[strings.LastIndexByte(jwt, '.')+1:] + `"}`},
	} {
		f.Add(s.status, []byte(s.body))
	}
	tok := filepath.Join(f.TempDir(), "token")
	if err := os.WriteFile(tok, []byte(jwt), 0o600); err != nil {
		f.Fatal(err)
	}
	sig := jwt[strings.LastIndexByte(jwt, '.')+1:]
	f.Fuzz(func(t *testing.T, status int, body []byte) {
		if status < 100 || status > 599 {
			return
		}
		c, err := cloud.New(cloud.Config{BaseURL: "https://api.invalid/api/1", Customer: customer, TokenFile: tok,
			MaxAttempts: 1, CallTimeout: time.Second, HTTPClient: &http.Client{Transport: answer{status, body}}})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		var errs []error
		_, err = c.ListLocations(ctx)
		errs = append(errs, err)
		id, err := c.CreateDisk(ctx, "ch-lug-1", cloud.DiskSpec{Name: "pvc-1", SizeGiB: 1})
		if err == nil && id <= 0 {
			t.Fatalf("create disk answered %d %q: id %d without an error", status, body, id)
		}
		errs = append(errs, err)
		sid, err := c.CreateSnapshot(ctx, "ch-lug-1", 7, "snap-1")
		if err == nil && sid == "" {
			t.Fatalf("snapshot answered %d %q: no id and no error", status, body)
		}
		errs = append(errs, err)
		cid, err := c.CloneSnapshot(ctx, "ch-lug-1", 7, "s", "pvc-2", "")
		if err == nil && cid <= 0 {
			t.Fatalf("clone answered %d %q: id %d without an error", status, body, cid)
		}
		errs = append(errs, err)
		_, err = c.FindDiskByName(ctx, "ch-lug-1", "pvc-1")
		errs = append(errs, err)
		_, err = c.GetDisk(ctx, "ch-lug-1", 7)
		errs = append(errs, err)
		_, err = c.ListDisks(ctx, "ch-lug-1")
		errs = append(errs, err)
		_, err = c.ListSnapshots(ctx, "ch-lug-1", 7)
		errs = append(errs, err)
		_, err = c.ListDiskNotes(ctx, "ch-lug-1", 7)
		errs = append(errs, err)
		_, err = c.ListCloudspaces(ctx)
		errs = append(errs, err)
		_, err = c.ListVMs(ctx, "cs-1")
		errs = append(errs, err)
		_, err = c.ListVMDisks(ctx, "cs-1", 3)
		errs = append(errs, err)
		errs = append(errs, c.DetachDisk(ctx, "cs-1", 3, 7))
		for i, err := range errs {
			if err == nil {
				continue
			}
			msg := err.Error()
			if strings.Contains(msg, jwt) || strings.Contains(msg, sig) {
				t.Fatalf("call %d: the credential leaked into the error: %q", i, msg)
			}
			var ae *cloud.APIError
			if !errors.As(err, &ae) {
				t.Fatalf("call %d: error %v (%T) is not an APIError", i, err, err)
			}
			if ae.Kind == nil {
				t.Fatalf("call %d: error %v has no kind", i, err)
			}
		}
	})
}
