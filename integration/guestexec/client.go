package guestexec

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/internal/unixsock"
)

// Client speaks to one guest's exec server through the unix socket QEMU
// serves for the guest's virtio-serial port.
type Client struct {
	conn net.Conn

	wmu    sync.Mutex
	mu     sync.Mutex
	nextID uint64
	wait   map[uint64]chan *Response
	err    error // set once the reader stops
	done   chan struct{}
}

// Result is what a finished command left behind.
type Result struct {
	Stdout   string
	Stderr   string
	Exit     int
	TimedOut bool
}

// String gives a result in one line for error messages.
func (r *Result) String() string {
	return fmt.Sprintf("exit %d (timed out %v); stdout %q; stderr %q", r.Exit, r.TimedOut, r.Stdout, r.Stderr)
}

// Dial connects to socketPath and waits, until ctx ends, for the guest's
// server to answer a hello. A guest that is still booting simply answers
// later, so Dial doubles as "wait for the guest to be up".
func Dial(ctx context.Context, socketPath string) (*Client, error) {
	conn, err := unixsock.DialRetry(ctx, socketPath, 100*time.Millisecond)
	if err != nil {
		return nil, fmt.Errorf("connecting to guest exec socket %s: %w", socketPath, err)
	}
	c := &Client{conn: conn, wait: map[uint64]chan *Response{}, done: make(chan struct{})}
	go c.read()

	var nb [8]byte
	_, _ = rand.Read(nb[:])
	nonce := hex.EncodeToString(nb[:])
	for {
		attempt, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := c.call(attempt, &Request{Op: OpHello, Nonce: nonce})
		cancel()
		if err == nil && resp.Nonce == nonce {
			return c, nil
		}
		if ctx.Err() != nil || c.readerErr() != nil {
			c.Close()
			if err == nil {
				err = ctx.Err()
			}
			return nil, fmt.Errorf("guest exec server on %s did not answer: %w", socketPath, err)
		}
	}
}

// Close drops the connection; jobs in the guest keep running.
func (c *Client) Close() error { return c.conn.Close() }

func (c *Client) readerErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *Client) read() {
	r := bufio.NewReader(c.conn)
	for {
		var resp Response
		err := readFrame(r, &resp)
		if errors.Is(err, errBadFrame) {
			continue
		}
		if err != nil {
			c.mu.Lock()
			c.err = fmt.Errorf("guest exec channel closed: %w", err)
			c.mu.Unlock()
			close(c.done)
			return
		}
		c.mu.Lock()
		ch := c.wait[resp.ID]
		delete(c.wait, resp.ID)
		c.mu.Unlock()
		if ch != nil {
			ch <- &resp
		}
	}
}

func (c *Client) call(ctx context.Context, req *Request) (*Response, error) {
	ch := make(chan *Response, 1)
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return nil, c.err
	}
	c.nextID++
	req.ID = c.nextID
	c.wait[req.ID] = ch
	c.mu.Unlock()
	forget := func() {
		c.mu.Lock()
		delete(c.wait, req.ID)
		c.mu.Unlock()
	}

	c.wmu.Lock()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.conn.SetWriteDeadline(dl)
	}
	err := writeFrame(c.conn, req)
	_ = c.conn.SetWriteDeadline(time.Time{})
	c.wmu.Unlock()
	if err != nil {
		forget()
		return nil, fmt.Errorf("sending %s request to guest: %w", req.Op, err)
	}
	select {
	case resp := <-ch:
		return resp, nil
	case <-ctx.Done():
		forget()
		return nil, ctx.Err()
	case <-c.done:
		return nil, c.readerErr()
	}
}

// guestTimeout is the time the guest gets for a command: the explicit one,
// else what is left of ctx, so a command does not outlive its caller.
func guestTimeout(ctx context.Context, explicit time.Duration) time.Duration {
	if explicit > 0 {
		return explicit
	}
	if dl, ok := ctx.Deadline(); ok {
		return time.Until(dl)
	}
	return 0
}

// Run runs argv in the guest, waits for it, and returns its output. The
// guest kills the command (and its process group) after timeout, or when
// ctx's deadline passes if timeout is 0. An error means the command could
// not be run or the channel failed; a command that ran and failed returns a
// Result with a non-zero Exit and no error.
func (c *Client) Run(ctx context.Context, timeout time.Duration, argv ...string) (*Result, error) {
	return c.RunInput(ctx, timeout, nil, argv...)
}

// RunInput is Run with bytes for the command's stdin.
func (c *Client) RunInput(ctx context.Context, timeout time.Duration, stdin []byte, argv ...string) (*Result, error) {
	t := guestTimeout(ctx, timeout)
	req := &Request{Op: OpRun, Argv: argv, Stdin: stdin, TimeoutMs: t.Milliseconds()}
	resp, err := c.call(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("running %q in guest: %w", strings.Join(argv, " "), err)
	}
	if resp.Err != "" {
		return nil, fmt.Errorf("running %q in guest: %s", strings.Join(argv, " "), resp.Err)
	}
	return &Result{Stdout: string(resp.Stdout), Stderr: string(resp.Stderr), Exit: resp.Exit, TimedOut: resp.TimedOut}, nil
}

// Sh runs a busybox shell command line in the guest.
func (c *Client) Sh(ctx context.Context, script string) (*Result, error) {
	return c.Run(ctx, 0, "/bin/sh", "-c", script)
}

// Start starts argv in the background in the guest and returns its job
// number for Wait and Kill.
func (c *Client) Start(ctx context.Context, argv ...string) (int, error) {
	resp, err := c.call(ctx, &Request{Op: OpStart, Argv: argv})
	if err != nil {
		return 0, fmt.Errorf("starting %q in guest: %w", strings.Join(argv, " "), err)
	}
	if resp.Err != "" {
		return 0, fmt.Errorf("starting %q in guest: %s", strings.Join(argv, " "), resp.Err)
	}
	return resp.Job, nil
}

// Wait waits up to timeout (0: what is left of ctx) for a background job to
// end. If it is still running, the Result has TimedOut set and the output
// so far; the job keeps running.
func (c *Client) Wait(ctx context.Context, job int, timeout time.Duration) (*Result, error) {
	t := guestTimeout(ctx, timeout)
	resp, err := c.call(ctx, &Request{Op: OpWait, Job: job, TimeoutMs: t.Milliseconds()})
	if err != nil {
		return nil, fmt.Errorf("waiting for guest job %d: %w", job, err)
	}
	if resp.Err != "" {
		return nil, fmt.Errorf("waiting for guest job %d: %s", job, resp.Err)
	}
	return &Result{Stdout: string(resp.Stdout), Stderr: string(resp.Stderr), Exit: resp.Exit, TimedOut: resp.TimedOut}, nil
}

// Kill sends sig to a background job's process group.
func (c *Client) Kill(ctx context.Context, job int, sig syscall.Signal) error {
	resp, err := c.call(ctx, &Request{Op: OpKill, Job: job, Signal: int(sig)})
	if err != nil {
		return fmt.Errorf("signalling guest job %d: %w", job, err)
	}
	if resp.Err != "" {
		return fmt.Errorf("signalling guest job %d: %s", job, resp.Err)
	}
	return nil
}
