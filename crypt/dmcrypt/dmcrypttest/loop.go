// Package dmcrypttest stands in for dm-crypt in host tests: this host's
// kernel has no device-mapper. LoopMapping checks the passphrase against the
// volume's real LUKS2 header, then maps the data segment with a plain loop
// device at the header's data offset. The mapping is FAKE (unencrypted);
// mkfs, mount and resize run on it for real. Real dm-crypt is exercised in
// the lab's guests. Imported by tests only, never linked into a binary.
package dmcrypttest

import (
	"context"
	"fmt"
	"maps"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/whitesky-cloud/vco-storage/crypt/luks2"
)

// Reader names the fake where a mapping says who set it up.
const Reader = "FAKE loop mapping (dmcrypttest)"

// LoopMapping is the fake mapping; its methods have the shape of the
// agent's crypt interface (Open, Close, Resize) so a test type can embed
// it beside the real LUKS2 formatting and inspection.
type LoopMapping struct {
	t       testing.TB
	mu      sync.Mutex
	maps    map[string]string
	opened  int
	closed  int
	resized int
}

// NewLoopMapping returns a LoopMapping whose loop devices still mapped
// when t ends are detached then.
func NewLoopMapping(t testing.TB) *LoopMapping {
	return &LoopMapping{t: t, maps: map[string]string{}}
}

// Open checks pass against device's LUKS2 header and maps its data segment
// as name.
func (l *LoopMapping) Open(_ context.Context, device, name string, pass []byte, _ bool) (string, error) {
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
	// Only a mapping still open is detached at the end: once closed, its
	// loop device number may already belong to another test's device.
	l.t.Cleanup(func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.maps[name] == mapped {
			exec.Command("losetup", "-d", mapped).Run()
			delete(l.maps, name)
		}
	})
	l.maps[name] = mapped
	l.opened++
	return mapped, nil
}

// Close detaches the mapping's loop device; an unknown name is not an
// error, as closing dm-crypt twice is not.
func (l *LoopMapping) Close(_ context.Context, name string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m, ok := l.maps[name]; ok {
		if out, err := exec.Command("losetup", "-d", m).CombinedOutput(); err != nil {
			return fmt.Errorf("losetup -d %s: %v %s", m, err, out)
		}
		delete(l.maps, name)
		l.closed++
	}
	return nil
}

// Resize makes the mapping's loop device pick up its backing device's size.
func (l *LoopMapping) Resize(_ context.Context, name string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	m, ok := l.maps[name]
	if !ok {
		return fmt.Errorf("no mapping named %s", name)
	}
	if out, err := exec.Command("losetup", "-c", m).CombinedOutput(); err != nil {
		return fmt.Errorf("losetup -c %s: %v %s", m, err, out)
	}
	l.resized++
	return nil
}

// Counts reports how many mappings were opened, closed and resized.
func (l *LoopMapping) Counts() (opened, closed, resized int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.opened, l.closed, l.resized
}

// Mapped returns the open mappings, name to loop device.
func (l *LoopMapping) Mapped() map[string]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.maps)
}
