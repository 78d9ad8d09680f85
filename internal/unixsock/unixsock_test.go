package unixsock

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

func TestDialRetryWaitsForTheSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s")
	listening := make(chan net.Listener, 1)
	go func() {
		time.Sleep(100 * time.Millisecond)
		l, err := net.Listen("unix", path)
		if err != nil {
			t.Error(err)
			close(listening)
			return
		}
		listening <- l
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := DialRetry(ctx, path, 10*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if l := <-listening; l != nil {
		l.Close()
	}
}

func TestDialRetryReturnsTheLastErrorWhenCtxEnds(t *testing.T) {
	path := filepath.Join(t.TempDir(), "absent")
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	c, err := DialRetry(ctx, path, 10*time.Millisecond)
	if c != nil {
		c.Close()
		t.Fatal("dialled a socket that does not exist")
	}
	if !errors.Is(err, os.ErrNotExist) && !errors.Is(err, syscall.ENOENT) && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want the dial's error", err)
	}
}
