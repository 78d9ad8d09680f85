package lab

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestBootRetryingBootsAHungGuestOnceMore: a guest that did not answer is
// booted once more, its hung boot's console kept; any other failure, or a
// second hang, is the answer.
func TestBootRetryingBootsAHungGuestOnceMore(t *testing.T) {
	ctx := context.Background()
	exited := errors.New("QEMU exited during boot")
	for _, c := range []struct {
		name  string
		fails []error // what each start returns, in turn
		want  error   // nil: a guest
		tries int
	}{
		{"up at once", []error{nil}, nil, 1},
		{"hung, then up", []error{errNoAnswer, nil}, nil, 2},
		{"hung twice", []error{errNoAnswer, errNoAnswer}, errNoAnswer, 2},
		{"QEMU exited", []error{exited}, exited, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			tries := 0
			g, err := bootRetrying(ctx, dir, func() (*Guest, error) {
				if err := os.WriteFile(filepath.Join(dir, "console.log"), []byte{byte('0' + tries)}, 0o644); err != nil {
					t.Fatal(err)
				}
				e := c.fails[tries]
				tries++
				if e != nil {
					return nil, e
				}
				return &Guest{Dir: dir}, nil
			})
			ok := g != nil && err == nil
			if c.want != nil {
				ok = g == nil && errors.Is(err, c.want)
			}
			if tries != c.tries || !ok {
				t.Fatalf("%d starts, guest %v, %v; want %d starts and %v", tries, g != nil, err, c.tries, c.want)
			}
			if c.tries == 2 {
				if b, err := os.ReadFile(filepath.Join(dir, "console-hung.log")); err != nil || string(b) != "0" {
					t.Fatalf("the hung boot's console: %q %v", b, err)
				}
			}
		})
	}
}
