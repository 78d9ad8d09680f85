// Package guestexec runs commands inside a lab guest over a virtio-serial
// port and brings back their output and exit status.
//
// The lab's guests have no network that reaches the host (nothing but
// loopback may carry test traffic), so the only channel into a guest is a
// virtio-serial port that QEMU exposes on the host as a unix socket. A serial
// port is one byte stream without message boundaries, may hold stale bytes
// from an earlier host connection, and may be opened by the host at any time
// after the guest started; the protocol here is built for that: every frame
// starts with a magic word so a reader can resynchronise, every request
// carries an ID, and a client starts each connection with a hello carrying a
// fresh nonce and ignores everything until the guest echoes it.
//
// The guest side (Serve) is a small server that runs in the guest's
// initramfs; the host side (Client) is what tests and the vco-lab command use.
package guestexec

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// PortName is the virtio-serial port name the lab gives the exec channel.
const PortName = "vco.exec"

// frameMagic opens every frame: "VCOX".
const frameMagic uint32 = 0x56434f58

// maxFrame bounds a frame so a corrupt length cannot make a reader allocate
// without limit.
const maxFrame = 64 << 20

// Operations a request can ask for.
const (
	OpHello = "hello" // echo Nonce; proves the channel is live and in sync
	OpRun   = "run"   // run Argv to completion (or TimeoutMs) and return its output
	OpStart = "start" // start Argv in the background and return its Job number
	OpWait  = "wait"  // wait for Job to end (or TimeoutMs) and return its output
	OpKill  = "kill"  // send Signal to Job
)

// Request is one host-to-guest frame.
type Request struct {
	ID        uint64   `json:"id"`
	Op        string   `json:"op"`
	Nonce     string   `json:"nonce,omitempty"`
	Argv      []string `json:"argv,omitempty"`
	Env       []string `json:"env,omitempty"`
	Stdin     []byte   `json:"stdin,omitempty"`
	TimeoutMs int64    `json:"timeout_ms,omitempty"`
	Job       int      `json:"job,omitempty"`
	Signal    int      `json:"signal,omitempty"`
}

// Response is one guest-to-host frame, answering the request with the same ID.
type Response struct {
	ID     uint64 `json:"id"`
	Nonce  string `json:"nonce,omitempty"`
	Job    int    `json:"job,omitempty"`
	Stdout []byte `json:"stdout,omitempty"`
	Stderr []byte `json:"stderr,omitempty"`
	// Exit is the process exit code; -1 when it was killed by a signal or
	// could not be started.
	Exit int `json:"exit"`
	// TimedOut says the command was killed because its timeout passed
	// (run), or that it was still running when the wait timed out (wait).
	TimedOut bool `json:"timed_out,omitempty"`
	// Err is set when the request itself failed (unknown job, command not
	// found, bad request); a command that ran and failed reports Exit instead.
	Err string `json:"err,omitempty"`
}

func writeFrame(w io.Writer, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return err
	}
	buf := make([]byte, 8+len(body))
	binary.BigEndian.PutUint32(buf[0:4], frameMagic)
	binary.BigEndian.PutUint32(buf[4:8], uint32(len(body)))
	copy(buf[8:], body)
	_, err = w.Write(buf)
	return err
}

// errBadFrame marks a frame that had the magic but not a valid body; the
// reader skips it and goes on.
var errBadFrame = errors.New("guestexec: malformed frame")

// readFrame reads the next frame into v, skipping any bytes before a magic
// word. It returns errBadFrame for a frame it cannot decode.
func readFrame(r *bufio.Reader, v any) error {
	var window uint32
	for n := 0; ; n++ {
		b, err := r.ReadByte()
		if err != nil {
			return err
		}
		window = window<<8 | uint32(b)
		if n >= 3 && window == frameMagic {
			break
		}
	}
	var lenb [4]byte
	if _, err := io.ReadFull(r, lenb[:]); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(lenb[:])
	if n > maxFrame {
		return fmt.Errorf("%w: length %d", errBadFrame, n)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return err
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("%w: %v", errBadFrame, err)
	}
	return nil
}
