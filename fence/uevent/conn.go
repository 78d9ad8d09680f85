package uevent

import (
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Group selects the multicast groups to listen to.
type Group uint32

const (
	// GroupKernel is the kernel's own events.
	GroupKernel Group = 1
	// GroupUdev is udev's events, after its rules ran.
	GroupUdev Group = 2
)

// Conn is a netlink uevent socket.
type Conn struct {
	f *os.File
}

// Dial opens a NETLINK_KOBJECT_UEVENT socket bound to groups. Listening
// needs no privilege; acting on what is heard does.
func Dial(groups Group) (*Conn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_KOBJECT_UEVENT)
	if err != nil {
		return nil, fmt.Errorf("opening a uevent netlink socket: %w", err)
	}
	fail := func(what string, err error) (*Conn, error) {
		unix.Close(fd)
		return nil, fmt.Errorf("uevent netlink socket: %s: %w", what, err)
	}
	// A burst of hot-plug events (many disks attached at once) must not
	// overflow the queue; ENOBUFS is still reported if it does.
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20); err != nil {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 8<<20); err != nil {
			return fail("setting the receive buffer", err)
		}
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		return fail("asking for sender credentials", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: uint32(groups)}); err != nil {
		return fail(fmt.Sprintf("joining groups %d", groups), err)
	}
	return &Conn{f: os.NewFile(uintptr(fd), "uevent")}, nil
}

// Close closes the socket; a blocked Read returns.
func (c *Conn) Close() error { return c.f.Close() }

// SetReadDeadline bounds the next Read.
func (c *Conn) SetReadDeadline(t time.Time) error { return c.f.SetReadDeadline(t) }

// ErrOverrun is returned when the kernel dropped events because the
// socket's queue was full; the caller should rescan what it watches.
var ErrOverrun = errors.New("uevent queue overrun: events were lost")

// Read returns the next event, with the time it was received. Messages
// that are not from the kernel or from a root process, and messages that
// do not parse, are skipped.
func (c *Conn) Read() (Event, time.Time, error) {
	rc, err := c.f.SyscallConn()
	if err != nil {
		return Event{}, time.Time{}, err
	}
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(unix.SizeofUcred))
	for {
		var (
			n, oobn int
			from    unix.Sockaddr
			rerr    error
		)
		err := rc.Read(func(fd uintptr) bool {
			n, oobn, _, from, rerr = unix.Recvmsg(int(fd), buf, oob, 0)
			return rerr != unix.EAGAIN
		})
		at := time.Now()
		if err != nil {
			return Event{}, at, err
		}
		if errors.Is(rerr, unix.ENOBUFS) {
			return Event{}, at, ErrOverrun
		}
		if rerr != nil {
			return Event{}, at, fmt.Errorf("receiving a uevent: %w", rerr)
		}
		if !trusted(from, oob[:oobn]) {
			continue
		}
		ev, perr := Parse(buf[:n])
		if perr != nil {
			continue
		}
		return ev, at, nil
	}
}

// trusted accepts the kernel (netlink port 0) and root processes (udev).
// Only a privileged process can send to these groups, but udev itself
// checks the credentials too, and so do we.
func trusted(from unix.Sockaddr, oob []byte) bool {
	nl, ok := from.(*unix.SockaddrNetlink)
	if !ok {
		return false
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return false
	}
	for _, m := range msgs {
		cred, err := unix.ParseUnixCredentials(&m)
		if err != nil {
			continue
		}
		if nl.Pid == 0 {
			return cred.Pid == 0 || cred.Uid == 0
		}
		return cred.Uid == 0
	}
	return nl.Pid == 0
}
