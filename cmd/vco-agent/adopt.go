package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/whitesky-cloud/vco-storage/agent/adopt"
	"github.com/whitesky-cloud/vco-storage/fence"
	"github.com/whitesky-cloud/vco-storage/smbios"
)

const adoptSummary = `usage: vco-agent adopt [--uuid UUID] DEVICE

Turns a volume of the earlier whitesky.cloud CSI driver (its ext4 at byte 0
of the disk, no lease area) into a lease-fenced volume in place: moves the
filesystem up by 1 MiB and writes a lease area before it. Grow the disk by
1 GiB first (resize the PVC or through the portal), and run it while no pod
uses the volume; the disk is opened exclusively. An adoption cut short is
finished by running the command again. docs/storage.md, "Volumes of the
earlier driver".`

func runAdopt(args []string) int {
	fs := flag.NewFlagSet("adopt", flag.ContinueOnError)
	fs.Usage = func() { fmt.Fprintln(os.Stderr, adoptSummary); fs.PrintDefaults() }
	uuid := fs.String("uuid", "", "this node's SMBIOS UUID, recorded as the lease area's creator (default: read from sysfs)")
	sysfs := fs.String("sysfs-root", "/sys", "sysfs root, to read the SMBIOS UUID")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return 2
	}
	if *uuid == "" {
		info, err := smbios.Read(*sysfs)
		if err != nil {
			return fail("adopt", fmt.Errorf("this node's identity: %w (pass --uuid to give it)", err))
		}
		*uuid = info.UUID
	}
	key, err := fence.KeyFromUUID(*uuid)
	if err != nil {
		return fail("adopt", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	res, err := adopt.Adopt(ctx, fs.Arg(0), adopt.Options{Key: key, Logger: log})
	if err != nil {
		return fail("adopt", err)
	}
	switch {
	case res.AlreadyLease:
		fmt.Fprintf(stdout, "%s already is a lease volume: nothing to adopt\n", fs.Arg(0))
	default:
		fmt.Fprintf(stdout, "%s adopted: its filesystem (%d bytes) now starts at 1 MiB, after a lease area; stage it as any volume\n", fs.Arg(0), res.FilesystemBytes)
	}
	return 0
}
