package guestexec

import (
	"bufio"
	"bytes"
	"context"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// serve runs a Server on a unix socket standing in for QEMU's end of the
// virtio-serial port, accepting one connection after another as the port
// does, and returns a connected client.
func serve(t *testing.T) (*Client, string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "exec.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	srv := NewServer()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = srv.Serve(ctx, c)
			c.Close()
		}
	}()
	t.Cleanup(func() { cancel(); ln.Close() })
	dctx, dcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer dcancel()
	c, err := Dial(dctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, sock
}

func TestRunOutputAndExitCode(t *testing.T) {
	c, _ := serve(t)
	ctx := context.Background()
	r, err := c.RunInput(ctx, 10*time.Second, []byte("from stdin"), "/bin/sh", "-c", "cat; echo out; echo err >&2; exit 7")
	if err != nil {
		t.Fatal(err)
	}
	if r.Stdout != "from stdinout\n" || r.Stderr != "err\n" || r.Exit != 7 || r.TimedOut {
		t.Fatalf("got %s", r)
	}
	if _, err := c.Run(ctx, time.Second, "/nonexistent/command"); err == nil || !strings.Contains(err.Error(), "nonexistent") {
		t.Fatalf("running a missing command: err %v, want one naming it", err)
	}
}

func TestRunTimeoutKillsProcessGroup(t *testing.T) {
	c, _ := serve(t)
	start := time.Now()
	// The shell's child sleep must die too, or the pipes stay open.
	r, err := c.Run(context.Background(), 300*time.Millisecond, "/bin/sh", "-c", "echo started; sleep 30; echo never")
	if err != nil {
		t.Fatal(err)
	}
	if !r.TimedOut || r.Exit == 0 || r.Stdout != "started\n" {
		t.Fatalf("got %s, want a timed-out command with its early output", r)
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("timed-out command took %s to return", el)
	}
}

func TestBackgroundJobs(t *testing.T) {
	c, sock := serve(t)
	ctx := context.Background()
	job, err := c.Start(ctx, "/bin/sh", "-c", "echo begin; sleep 30")
	if err != nil {
		t.Fatal(err)
	}
	r, err := c.Wait(ctx, job, 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if !r.TimedOut {
		t.Fatalf("wait on a running job: %s, want timed out", r)
	}
	// A job outlives the connection: reconnect, then kill and reap it.
	c.Close()
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c2, err := Dial(dctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if err := c2.Kill(ctx, job, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	r, err = c2.Wait(ctx, job, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if r.TimedOut || r.Exit == 0 || r.Stdout != "begin\n" {
		t.Fatalf("killed job: %s", r)
	}
	if _, err := c2.Wait(ctx, job, time.Second); err == nil {
		t.Fatal("a reaped job can be waited for again")
	}
}

func TestConcurrentRequests(t *testing.T) {
	c, _ := serve(t)
	ctx := context.Background()
	slow := make(chan error, 1)
	go func() {
		_, err := c.Run(ctx, 10*time.Second, "/bin/sh", "-c", "sleep 2")
		slow <- err
	}()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	r, err := c.Run(ctx, 5*time.Second, "/bin/echo", "quick")
	if err != nil || r.Stdout != "quick\n" {
		t.Fatalf("quick command: %v %v", r, err)
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("a quick command waited %s behind a slow one", el)
	}
	if err := <-slow; err != nil {
		t.Fatal(err)
	}
}

func TestReadFrameResynchronises(t *testing.T) {
	var buf bytes.Buffer
	buf.WriteString("stale bytes VCO from an earlier connection")
	// A frame with the magic but a body that is not JSON.
	buf.Write([]byte{'V', 'C', 'O', 'X', 0, 0, 0, 3, 'x', 'y', 'z'})
	if err := writeFrame(&buf, &Request{ID: 42, Op: OpHello, Nonce: "n"}); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(&buf)
	var req Request
	if err := readFrame(r, &req); err == nil {
		t.Fatal("malformed frame accepted")
	}
	if err := readFrame(r, &req); err != nil {
		t.Fatal(err)
	}
	if req.ID != 42 || req.Nonce != "n" {
		t.Fatalf("got %+v", req)
	}
}
