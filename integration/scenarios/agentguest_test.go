package scenarios

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/lab/labtest"
)

// agentConfig is the configuration the scenarios run the agent daemon
// with in a guest: no D-Bus (the guests have none), a short claim check,
// unfenced disks allowed only where the request opts in too, and a lease
// timing scaled down from the defaults' proportions so that a takeover
// after expiry (max(fail+watchdog+io, renew+6*io) = 9s) fits a test.
// The scenarios stop agents that hold leases on purpose, so no host
// watchdog is armed (watchdog_device: none-unsafe); TestWatchdogResets
// proves the watchdog.
const agentConfig = `dbus:
  enabled: false
volumes:
  check_interval: 1s
  allow_unfenced: true
  lease:
    io_timeout: 1s
    renew: 2s
    fail: 8s
    watchdog: 0s
    watchdog_device: none-unsafe
`

// startAgent runs `vco-agent serve` in g in the background, as systemd
// would, and waits until it answers on its socket.
func startAgent(t *testing.T, ctx context.Context, g *lab.Guest) {
	t.Helper()
	startAgentWith(t, ctx, g, agentConfig)
}

// startAgentWith is startAgent with another configuration.
func startAgentWith(t *testing.T, ctx context.Context, g *lab.Guest, config string) {
	t.Helper()
	script := fmt.Sprintf(`mkdir -p /etc/vco-agent /var/lib/kubelet /run/vco-agent
cat > /etc/vco-agent/config.yaml <<'EOF'
%sEOF
setsid /bin/vco-agent serve --config /etc/vco-agent/config.yaml --log-level debug >>/run/agent.log 2>&1 </dev/null &
echo $! > /run/agent.pid
for i in $(seq 150); do /bin/vco-agent status >/dev/null 2>&1 && exit 0; sleep 0.2; done
echo "the agent did not come up:" >&2; tail -n 30 /run/agent.log >&2; exit 1`, config)
	if _, err := g.MustSh(ctx, script); err != nil {
		t.Fatalf("%s: %v", g.Name, err)
	}
}

// stopAgent stops the agent with SIGTERM and waits for it to exit.
func stopAgent(t *testing.T, ctx context.Context, g *lab.Guest) {
	t.Helper()
	if _, err := g.MustSh(ctx, `p=$(cat /run/agent.pid); kill -TERM $p
for i in $(seq 100); do kill -0 $p 2>/dev/null || exit 0; sleep 0.1; done
echo "the agent did not stop" >&2; exit 1`); err != nil {
		t.Fatalf("%s: %v", g.Name, err)
	}
}

// agentLab starts a lab for guests that run the agent (labtest.Start),
// with losetup for a lease disk's data mapping, and logs each guest's
// agent log, before the lab goes, when t failed.
func agentLab(t *testing.T, ctx context.Context) *lab.Lab {
	t.Helper()
	return agentLabWith(t, ctx)
}

// agentLabWith is agentLab with more host tools in the guests.
func agentLabWith(t *testing.T, ctx context.Context, tools ...string) *lab.Lab {
	t.Helper()
	l := labtest.Start(t, ctx, 20, func(cfg *lab.Config) {
		cfg.HostTools = append(append(append([]string{}, lab.DefaultHostTools...), "/usr/sbin/losetup"), tools...)
	})
	t.Cleanup(func() {
		if t.Failed() {
			for _, g := range l.Guests {
				t.Logf("%s agent log:\n%s", g.Name, agentLog(context.Background(), g))
			}
		}
	})
	return l
}

// agentLog is the tail of the guest agent's log, for failure messages.
func agentLog(ctx context.Context, g *lab.Guest) string {
	r, err := g.Sh(ctx, "tail -n 40 /run/agent.log")
	if err != nil {
		return err.Error()
	}
	return r.Stdout
}

// agentJSON runs a vco-agent client command with --json in g and decodes
// its output; a non-zero exit is returned as an error carrying stderr.
func agentJSON(ctx context.Context, g *lab.Guest, v any, argv ...string) error {
	full := append([]string{"/bin/vco-agent"}, argv...)
	full = append(full, "--json")
	r, err := g.Exec().Run(ctx, 0, full...)
	// A call that meets another on the same volume (the agent's periodic
	// claim check) is ABORTED; kubelet retries it, and so does this.
	for i := 0; err == nil && r.Exit != 0 && strings.Contains(r.Stderr, "answered Aborted") && i < 30; i++ {
		time.Sleep(200 * time.Millisecond)
		r, err = g.Exec().Run(ctx, 0, full...)
	}
	if err != nil {
		return err
	}
	if r.Exit != 0 {
		return &cliError{argv: strings.Join(argv, " "), exit: r.Exit, stderr: strings.TrimSpace(r.Stderr)}
	}
	if v == nil {
		return nil
	}
	if err := json.Unmarshal([]byte(r.Stdout), v); err != nil {
		return fmt.Errorf("%s: vco-agent %s: output is not JSON: %v\n%s", g.Name, strings.Join(argv, " "), err, r.Stdout)
	}
	return nil
}

type cliError struct {
	argv   string
	exit   int
	stderr string
}

func (e *cliError) Error() string {
	return fmt.Sprintf("vco-agent %s: exit %d: %s", e.argv, e.exit, e.stderr)
}
