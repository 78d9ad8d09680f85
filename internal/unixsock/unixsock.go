// Package unixsock dials Unix sockets that a process still starting may
// not have created yet (a guest's exec server, QEMU's QMP socket).
package unixsock

import (
	"context"
	"net"
	"time"
)

// DialRetry dials the Unix socket at path, again every interval, until a
// dial succeeds or ctx ends; then it returns the last dial's error.
func DialRetry(ctx context.Context, path string, every time.Duration) (net.Conn, error) {
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", path)
		if err == nil {
			return c, nil
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(every):
		}
	}
}
