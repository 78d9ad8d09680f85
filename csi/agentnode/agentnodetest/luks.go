// Package agentnodetest holds what the node plugin's tests need to run
// vco-agent's volume manager on this host: LoopLUKS, the agent's real
// LUKS2 support with a FAKE dm-crypt mapping, because the host kernel has
// no device-mapper. It is imported by tests only and never linked into a
// binary; real dm-crypt runs in the lab's guests.
package agentnodetest

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/whitesky-cloud/vco-storage/agent/volume"
	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// LoopLUKS formats, inspects and checks passphrases with the agent's real
// LUKS2 code; Open then maps the data segment with a plain loop device at
// the header's data offset (FAKE: unencrypted) so mkfs and mount run for
// real on it.
type LoopLUKS struct {
	volume.LUKS
	t    testing.TB
	mu   sync.Mutex
	maps map[string]string
}

// NewLoopLUKS returns a LoopLUKS with a cheap KDF (the cost is not what
// the tests check) whose loop devices go when t ends.
func NewLoopLUKS(t testing.TB) *LoopLUKS {
	return &LoopLUKS{LUKS: volume.LUKS{KDF: luks2.KDFParams{Time: 1, MemoryKiB: 32, Threads: 1}}, t: t, maps: map[string]string{}}
}

// Open checks the passphrase against the header and maps the data segment.
func (l *LoopLUKS) Open(_ context.Context, device, name string, pass []byte, _ bool) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m, ok := l.maps[name]; ok {
		return "", fmt.Errorf("a mapping named %s already exists (%s)", name, m)
	}
	v, err := luks2.Open(device, false)
	if err != nil {
		return "", err
	}
	defer v.Close()
	key, _, err := v.Unlock(pass)
	clear(key)
	if err != nil {
		return "", err
	}
	out, err := exec.Command("losetup", "--find", "--show", "--offset", fmt.Sprint(v.DataOffset()), device).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("losetup: %v %s", err, out)
	}
	mapped := strings.TrimSpace(string(out))
	// Detach at the end only what is still mapped here: a device Close
	// already detached may belong to another test by then.
	l.t.Cleanup(func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.maps[name] == mapped {
			exec.Command("losetup", "-d", mapped).Run()
			delete(l.maps, name)
		}
	})
	l.maps[name] = mapped
	return mapped, nil
}

// Close removes the mapping's loop device.
func (l *LoopLUKS) Close(_ context.Context, name string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m, ok := l.maps[name]; ok {
		if out, err := exec.Command("losetup", "-d", m).CombinedOutput(); err != nil {
			return fmt.Errorf("losetup -d %s: %v %s", m, err, out)
		}
		delete(l.maps, name)
	}
	return nil
}

// Resize makes the mapping's loop device pick up its backing device's size.
func (l *LoopLUKS) Resize(_ context.Context, name string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	m, ok := l.maps[name]
	if !ok {
		return fmt.Errorf("no mapping named %s", name)
	}
	if out, err := exec.Command("losetup", "-c", m).CombinedOutput(); err != nil {
		return fmt.Errorf("losetup -c %s: %v %s", m, err, out)
	}
	return nil
}
