// Package peercred decides who may call the agent's API. The socket's file
// mode is the first gate; this is the second, and the one that holds even
// when a socket unit is configured too broadly: the kernel's SO_PEERCRED
// says which process connected, and only root or a member of the
// configured group is served. Others get PERMISSION_DENIED on every call.
package peercred

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"
)

// Creds identify the process at the other end of a unix socket.
type Creds struct {
	PID int32
	UID uint32
	GID uint32
	// Groups are the supplementary groups, read from /proc/<pid>/status at
	// connect time; nil when they could not be read.
	Groups []uint32
}

func (c Creds) String() string {
	return fmt.Sprintf("pid=%d uid=%d gid=%d groups=%v", c.PID, c.UID, c.GID, c.Groups)
}

// FromConn reads the peer's credentials of a unix socket connection.
func FromConn(conn net.Conn) (Creds, error) {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return Creds{}, fmt.Errorf("connection %T has no file descriptor to ask for peer credentials", conn)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return Creds{}, err
	}
	var (
		uc     *unix.Ucred
		getErr error
	)
	if err := raw.Control(func(fd uintptr) {
		uc, getErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Creds{}, err
	}
	if getErr != nil {
		return Creds{}, fmt.Errorf("SO_PEERCRED: %w", getErr)
	}
	c := Creds{PID: uc.Pid, UID: uc.Uid, GID: uc.Gid}
	// The pid could exit and be reused between connect and this read; the
	// uid and gid from the kernel stay authoritative, and the groups only
	// ever widen access for a process that still runs with that uid.
	if g, err := Groups(uc.Pid); err == nil {
		if st, err := procUID(uc.Pid); err == nil && st == uc.Uid {
			c.Groups = g
		}
	}
	return c, nil
}

// Groups reads the supplementary groups of a process.
func Groups(pid int32) ([]uint32, error) {
	v, err := statusField(pid, "Groups:")
	if err != nil {
		return nil, err
	}
	var out []uint32
	for _, f := range strings.Fields(v) {
		g, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("/proc/%d/status Groups: %q: %w", pid, f, err)
		}
		out = append(out, uint32(g))
	}
	return out, nil
}

func procUID(pid int32) (uint32, error) {
	v, err := statusField(pid, "Uid:")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(v)
	if len(f) < 2 {
		return 0, fmt.Errorf("/proc/%d/status Uid: %q", pid, v)
	}
	u, err := strconv.ParseUint(f[1], 10, 32) // effective uid
	return uint32(u), err
}

func statusField(pid int32, key string) (string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key); ok {
			return strings.TrimSpace(v), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", fmt.Errorf("/proc/%d/status has no %s line", pid, key)
}

// Policy is who may call: root always, plus members of one group.
type Policy struct {
	// GID is the allowed group, or -1 for root only.
	GID int64
	// GroupName is GID's name, for messages.
	GroupName string
}

// Allows reports whether c may call, and if not, why in one sentence.
func (p Policy) Allows(c Creds) (bool, string) {
	if c.UID == 0 {
		return true, ""
	}
	if p.GID < 0 {
		return false, fmt.Sprintf("uid %d is not root, and no socket group is configured", c.UID)
	}
	g := uint32(p.GID)
	if c.GID == g || slices.Contains(c.Groups, g) {
		return true, ""
	}
	return false, fmt.Sprintf("uid %d is neither root nor a member of group %s (gid %d)", c.UID, p.GroupName, p.GID)
}

// AuthInfo is what the handshake attaches to every call of a connection.
type AuthInfo struct {
	credentials.CommonAuthInfo
	Creds   Creds
	Allowed bool
	// Refusal says why a caller is refused.
	Refusal string
}

// AuthType implements credentials.AuthInfo.
func (AuthInfo) AuthType() string { return "peercred" }

// FromContext returns the AuthInfo of the call in ctx.
func FromContext(ctx context.Context) (AuthInfo, bool) {
	p, ok := peerFromContext(ctx)
	if !ok {
		return AuthInfo{}, false
	}
	ai, ok := p.(AuthInfo)
	return ai, ok
}

// Transport is the server-side grpc TransportCredentials that attaches
// AuthInfo to each accepted connection. Refused callers still complete the
// handshake so that they get a proper PERMISSION_DENIED status on their
// call rather than a closed connection.
type Transport struct {
	Policy Policy
}

var errClientSide = errors.New("peercred transport credentials are server-side only")

func (t Transport) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	c, err := FromConn(conn)
	if err != nil {
		return nil, nil, err
	}
	ok, why := t.Policy.Allows(c)
	return conn, AuthInfo{
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
		Creds:          c, Allowed: ok, Refusal: why,
	}, nil
}

func (t Transport) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errClientSide
}

func (t Transport) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}

func (t Transport) Clone() credentials.TransportCredentials { return t }

// OverrideServerName is part of the grpc interface; names do not apply to
// a local socket.
func (t Transport) OverrideServerName(string) error { return nil }
