// Command vco-agent is the whitesky.cloud node storage daemon and its
// operator CLI. Every subcommand lives in its own file of this package and
// is listed once in the table below.
package main

import (
	"fmt"
	"os"
	"sort"
)

// version is set at link time by the Makefile.
var version = "dev"

// command is one subcommand: it receives the arguments after its name and
// returns the process exit code.
type command struct {
	summary string
	run     func(args []string) int
}

func commands() map[string]command {
	return map[string]command{
		"version":  {"print the agent version", func([]string) int { fmt.Println(version); return 0 }},
		"serve":    {"run the agent daemon (started by systemd)", runServe},
		"identity": {"print this node's identity (from the agent, or read locally)", runIdentity},
		"status":   {"print the running agent's status", runStatus},
		"events":   {"print recent agent events; --follow for new ones", runEvents},
		"fence":    {"show, acquire, release or check a disk's reservation directly", runFence},
		"disks":    {"list the disks the agent sees with fencing method, state and holder", runDisks},
		"volume":   {"stage, unstage, expand a volume through the running agent; read its LUKS2 token", runVolume},
		"luks":     {"LUKS2 volumes: format, dump, test-passphrase, open, close, status, resize, add-key, remove-key, repair", runLuks},
		"lease":    {"show, format, acquire, release or check a disk's on-disk lease directly", runLease},
		"adopt":    {"turn a volume of the earlier driver (ext4 at byte 0) into a lease-fenced volume in place", runAdopt},
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: vco-agent <command> [flags]\n\ncommands:")
	cmds := commands()
	names := make([]string, 0, len(cmds))
	for n := range cmds {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-10s %s\n", n, cmds[n].summary)
	}
	fmt.Fprintln(os.Stderr, "\nRun 'vco-agent <command> --help' for a command's flags.")
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	cmd, ok := commands()[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "vco-agent: unknown command %q\n\n", os.Args[1])
		usage()
		os.Exit(2)
	}
	os.Exit(cmd.run(os.Args[2:]))
}
