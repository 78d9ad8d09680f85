package guestexec

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// outputLimit caps what is kept of one stream of one command.
const outputLimit = 16 << 20

// Server executes requests in the guest. Background jobs outlive a host
// connection, so a host can start a job, disconnect, reconnect and wait.
type Server struct {
	mu      sync.Mutex
	nextJob int
	jobs    map[int]*job
	wmu     sync.Mutex // serialises frames on the port
}

type job struct {
	cmd    *exec.Cmd
	stdout *capBuffer
	stderr *capBuffer
	done   chan struct{}
	exit   int
}

// NewServer returns a server with no jobs.
func NewServer() *Server { return &Server{jobs: map[int]*job{}} }

// FindPort returns the device node of the virtio-serial port with the given
// name, looking it up in sysfs because the guest runs no udev to make the
// /dev/virtio-ports links.
func FindPort(name string) (string, error) {
	ents, err := filepath.Glob("/sys/class/virtio-ports/*/name")
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		b, err := os.ReadFile(e)
		if err != nil {
			continue
		}
		if strings.TrimSpace(string(b)) == name {
			return "/dev/" + filepath.Base(filepath.Dir(e)), nil
		}
	}
	return "", fmt.Errorf("no virtio-serial port named %q in /sys/class/virtio-ports (is virtio_console loaded and the port configured?)", name)
}

// ServePort serves the virtio-serial device at path for ever. When the host
// side disconnects, reads end; the server reopens the port and goes on.
func (s *Server) ServePort(ctx context.Context, path string) error {
	for ctx.Err() == nil {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			log.Printf("guestexec: open %s: %v; retrying", path, err)
			time.Sleep(500 * time.Millisecond)
			continue
		}
		err = s.Serve(ctx, f)
		f.Close()
		if !errors.Is(err, io.EOF) {
			log.Printf("guestexec: %s: %v; reopening", path, err)
		}
		// A closed host end reads as EOF at once; do not spin.
		time.Sleep(100 * time.Millisecond)
	}
	return ctx.Err()
}

// Serve reads requests from rw and answers them until a read fails. Each
// request runs in its own goroutine, so a long command does not hold up a
// hello or a kill.
func (s *Server) Serve(ctx context.Context, rw io.ReadWriter) error {
	r := bufio.NewReader(rw)
	for {
		var req Request
		err := readFrame(r, &req)
		if errors.Is(err, errBadFrame) {
			continue
		}
		if err != nil {
			return err
		}
		go func() {
			resp := s.handle(ctx, &req)
			resp.ID = req.ID
			s.wmu.Lock()
			defer s.wmu.Unlock()
			if err := writeFrame(rw, resp); err != nil {
				log.Printf("guestexec: answering request %d: %v", req.ID, err)
			}
		}()
	}
}

func (s *Server) handle(ctx context.Context, req *Request) *Response {
	switch req.Op {
	case OpHello:
		return &Response{Nonce: req.Nonce}
	case OpRun:
		return s.run(ctx, req)
	case OpStart:
		return s.start(req)
	case OpWait:
		return s.wait(req)
	case OpKill:
		return s.kill(req)
	}
	return &Response{Exit: -1, Err: fmt.Sprintf("unknown operation %q", req.Op)}
}

func command(req *Request) (*exec.Cmd, *capBuffer, *capBuffer, error) {
	if len(req.Argv) == 0 {
		return nil, nil, nil, errors.New("empty command")
	}
	cmd := exec.Command(req.Argv[0], req.Argv[1:]...)
	cmd.Env = append(os.Environ(), req.Env...)
	if req.Stdin != nil {
		cmd.Stdin = bytes.NewReader(req.Stdin)
	}
	stdout, stderr := &capBuffer{}, &capBuffer{}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	// Its own process group, so a timeout or kill reaches the children a
	// shell command starts, not just the shell.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// Do not wait for ever on pipes a left-behind grandchild keeps open.
	cmd.WaitDelay = 2 * time.Second
	return cmd, stdout, stderr, nil
}

func exitCode(err error) (int, error) {
	if err == nil {
		return 0, nil
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), nil
	}
	if errors.Is(err, exec.ErrWaitDelay) {
		return 0, nil
	}
	return -1, err
}

func (s *Server) run(ctx context.Context, req *Request) *Response {
	cmd, stdout, stderr, err := command(req)
	if err != nil {
		return &Response{Exit: -1, Err: err.Error()}
	}
	if err := cmd.Start(); err != nil {
		return &Response{Exit: -1, Err: err.Error()}
	}
	var timeout <-chan time.Time
	if req.TimeoutMs > 0 {
		t := time.NewTimer(time.Duration(req.TimeoutMs) * time.Millisecond)
		defer t.Stop()
		timeout = t.C
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	timedOut := false
	var werr error
	select {
	case werr = <-waited:
	case <-timeout:
		timedOut = true
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		werr = <-waited
	case <-ctx.Done():
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		werr = <-waited
	}
	code, err := exitCode(werr)
	resp := &Response{Stdout: stdout.Bytes(), Stderr: stderr.Bytes(), Exit: code, TimedOut: timedOut}
	if err != nil {
		resp.Err = err.Error()
	}
	return resp
}

func (s *Server) start(req *Request) *Response {
	cmd, stdout, stderr, err := command(req)
	if err != nil {
		return &Response{Exit: -1, Err: err.Error()}
	}
	if err := cmd.Start(); err != nil {
		return &Response{Exit: -1, Err: err.Error()}
	}
	j := &job{cmd: cmd, stdout: stdout, stderr: stderr, done: make(chan struct{})}
	s.mu.Lock()
	s.nextJob++
	id := s.nextJob
	s.jobs[id] = j
	s.mu.Unlock()
	go func() {
		code, _ := exitCode(cmd.Wait())
		j.exit = code
		close(j.done)
	}()
	return &Response{Job: id}
}

func (s *Server) lookup(id int) (*job, *Response) {
	s.mu.Lock()
	defer s.mu.Unlock()
	j, ok := s.jobs[id]
	if !ok {
		return nil, &Response{Exit: -1, Err: fmt.Sprintf("no background job %d", id)}
	}
	return j, nil
}

func (s *Server) wait(req *Request) *Response {
	j, resp := s.lookup(req.Job)
	if resp != nil {
		return resp
	}
	var timeout <-chan time.Time
	if req.TimeoutMs > 0 {
		t := time.NewTimer(time.Duration(req.TimeoutMs) * time.Millisecond)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-j.done:
		s.mu.Lock()
		delete(s.jobs, req.Job)
		s.mu.Unlock()
		return &Response{Job: req.Job, Stdout: j.stdout.Bytes(), Stderr: j.stderr.Bytes(), Exit: j.exit}
	case <-timeout:
		return &Response{Job: req.Job, Stdout: j.stdout.Bytes(), Stderr: j.stderr.Bytes(), Exit: -1, TimedOut: true}
	}
}

func (s *Server) kill(req *Request) *Response {
	j, resp := s.lookup(req.Job)
	if resp != nil {
		return resp
	}
	sig := syscall.Signal(req.Signal)
	if sig == 0 {
		sig = syscall.SIGKILL
	}
	if err := syscall.Kill(-j.cmd.Process.Pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return &Response{Job: req.Job, Exit: -1, Err: err.Error()}
	}
	return &Response{Job: req.Job}
}

// capBuffer keeps the first outputLimit bytes written to it; it is safe for
// the concurrent writer and reader a background job has.
type capBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (c *capBuffer) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if room := outputLimit - c.buf.Len(); room > 0 {
		if len(p) > room {
			c.buf.Write(p[:room])
		} else {
			c.buf.Write(p)
		}
	}
	return len(p), nil
}

func (c *capBuffer) Bytes() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Clone(c.buf.Bytes())
}
