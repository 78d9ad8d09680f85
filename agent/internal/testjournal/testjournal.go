// Package testjournal listens on the systemd journal's native socket path
// in tests, on hosts where no journald owns it (such as build containers),
// and decodes the entries the code under test sends. Test processes of
// different packages take a file lock so that only one binds the path at
// a time.
package testjournal

import (
	"bytes"
	"encoding/binary"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Socket is the journal's native protocol socket.
const Socket = "/run/systemd/journal/socket"

const lockPath = "/run/vco-storage-testjournal.lock"

// Journal receives entries sent to Socket.
type Journal struct {
	c       *net.UnixConn
	mu      sync.Mutex
	entries []map[string]string
}

// Listen binds Socket for the rest of the test, or skips the test where a
// journald owns it or the test is not root.
func Listen(t testing.TB) *Journal {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("binding the journal socket path needs root")
	}
	lock, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)
		lock.Close()
	})
	if _, err := os.Stat(Socket); err == nil {
		t.Skip("a journald owns " + Socket + " here; this test needs the path free to listen on it")
	}
	var made []string
	for d := filepath.Dir(Socket); ; d = filepath.Dir(d) {
		if _, err := os.Stat(d); err == nil {
			break
		}
		made = append([]string{d}, made...)
	}
	for _, d := range made {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: Socket, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	j := &Journal{c: c}
	t.Cleanup(func() {
		c.Close()
		os.Remove(Socket)
		for i := len(made) - 1; i >= 0; i-- {
			os.Remove(made[i])
		}
	})
	go j.read()
	return j
}

func (j *Journal) read() {
	buf := make([]byte, 1<<20)
	for {
		n, err := j.c.Read(buf)
		if err != nil {
			return
		}
		if e, ok := Decode(buf[:n]); ok {
			j.mu.Lock()
			j.entries = append(j.entries, e)
			j.mu.Unlock()
		}
	}
}

// Wait returns the first entry whose field key has value want, waiting up
// to timeout; nil if none came.
func (j *Journal) Wait(key, want string, timeout time.Duration) map[string]string {
	deadline := time.Now().Add(timeout)
	for {
		j.mu.Lock()
		for _, e := range j.entries {
			if e[key] == want {
				j.mu.Unlock()
				return e
			}
		}
		j.mu.Unlock()
		if time.Now().After(deadline) {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Entries returns what arrived so far.
func (j *Journal) Entries() []map[string]string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return append([]map[string]string(nil), j.entries...)
}

// Decode parses one datagram of the journal native protocol: KEY=value
// lines, or KEY, newline, 64-bit little-endian length, value, newline.
func Decode(data []byte) (map[string]string, bool) {
	f := map[string]string{}
	for len(data) > 0 {
		nl := bytes.IndexByte(data, '\n')
		if nl < 0 {
			return nil, false
		}
		line := data[:nl]
		if eq := bytes.IndexByte(line, '='); eq >= 0 {
			f[string(line[:eq])] = string(line[eq+1:])
			data = data[nl+1:]
			continue
		}
		if len(data) < nl+9 {
			return nil, false
		}
		l := binary.LittleEndian.Uint64(data[nl+1 : nl+9])
		end := uint64(nl+9) + l
		if end+1 > uint64(len(data)) {
			return nil, false
		}
		f[string(line)] = string(data[nl+9 : end])
		data = data[end+1:]
	}
	return f, true
}
