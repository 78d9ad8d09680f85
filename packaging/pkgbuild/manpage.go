package pkgbuild

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
	"time"
)

// Subcommand is one entry of `vco-agent help` with its own --help text.
type Subcommand struct {
	Name, Summary, Help string
}

var commandLine = regexp.MustCompile(`^  ([a-z][a-z0-9-]*)\s+(.*)$`)

// ParseUsage reads the command list from the output of `vco-agent help`:
// the indented "name  summary" lines after "commands:".
func ParseUsage(usage string) []Subcommand {
	var out []Subcommand
	in := false
	sc := bufio.NewScanner(strings.NewReader(usage))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.TrimSpace(line) == "commands:":
			in = true
		case in && line == "":
			if len(out) > 0 {
				in = false
			}
		case in:
			if m := commandLine.FindStringSubmatch(line); m != nil {
				out = append(out, Subcommand{Name: m[1], Summary: strings.TrimSpace(m[2])})
			}
		}
	}
	return out
}

// HelpFromBinary runs the binary's help and each subcommand's --help. The
// binary must be built for the host's architecture.
func HelpFromBinary(bin string) ([]Subcommand, error) {
	usage, _ := runHelp(bin, "help")
	cmds := ParseUsage(usage)
	if len(cmds) == 0 {
		return nil, fmt.Errorf("%s help listed no commands; output:\n%s", bin, usage)
	}
	for i := range cmds {
		text, err := runHelp(bin, cmds[i].Name, "--help")
		if err != nil && text == "" {
			return nil, fmt.Errorf("%s %s --help: %w", bin, cmds[i].Name, err)
		}
		cmds[i].Help = text
	}
	return cmds, nil
}

// runHelp returns what a help invocation printed. Help may exit non-zero
// (flag packages differ on that); only an empty output is a failure.
func runHelp(bin string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C"}
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	err := cmd.Run()
	return strings.TrimRight(buf.String(), "\n"), err
}

// roffText escapes text for a no-fill block: backslashes, and control
// characters at the start of a line.
func roffText(s string) string {
	var b strings.Builder
	for _, line := range strings.Split(s, "\n") {
		line = strings.ReplaceAll(line, `\`, `\e`)
		if strings.HasPrefix(line, ".") || strings.HasPrefix(line, "'") {
			line = `\&` + line
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	return b.String()
}

// ManPage renders vco-agent(8) from the subcommands' help.
func ManPage(version string, date time.Time, cmds []Subcommand) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, ".TH VCO-AGENT 8 %q \"vco-agent %s\" \"System Administration\"\n", date.UTC().Format("2006-01-02"), version)
	b.WriteString(`.SH NAME
vco-agent \- whitesky.cloud node storage agent
.SH SYNOPSIS
.B vco-agent
.I command
.RI [ flags ]
.SH DESCRIPTION
.B vco-agent
runs on every Kubernetes node of a whitesky.cloud cluster as the systemd
service
.BR vco-agent.service ,
started through
.BR vco-agent.socket .
It reads the node's SMBIOS identity, fences cloud disks with SCSI\-3
persistent reservations or an on\-disk lease so that a ReadWriteOnce volume
is never written from two nodes, opens LUKS2 volumes, and does the node's
mounts for the vco\-csi plugin, which calls it over a unix socket.
The same binary is the operator's command line for the running agent.
.SH COMMANDS
`)
	for _, c := range cmds {
		fmt.Fprintf(&b, ".SS %s\n%s\n", c.Name, roffText(c.Summary))
		if strings.TrimSpace(c.Help) != "" {
			b.WriteString(".PP\n.nf\n")
			b.WriteString(roffText(c.Help))
			b.WriteString(".fi\n")
		}
	}
	b.WriteString(`.SH FILES
.TP
.I /etc/vco-agent/config.yaml
The configuration. Every key has a default; unknown keys are an error.
.TP
.I /run/vco-agent/agent.sock
The API socket, for root and the
.B vco-agent
group.
.TP
.I /var/lib/vco-agent
The agent's state.
.SH SEE ALSO
.BR systemctl (1),
.BR journalctl (1),
.BR systemd.socket (5)
`)
	return []byte(b.String())
}
