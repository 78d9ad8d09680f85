package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/csi/sim"
	"github.com/whitesky-cloud/vco-storage/smbios"
)

// runSim is `vco-lab sim`: the whitesky.cloud API simulator served on a
// loopback address, on its own (no lab, no guests), for the host tests and
// for trying the CSI plugin against it.
func runSim(args []string) int {
	fs := flag.NewFlagSet("vco-lab sim", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:8480", "loopback address to serve on")
	customer := fs.String("customer", "acme", "customer id the simulator answers for")
	tokenFile := fs.String("token-file", "", "if set, only the Bearer credential in this file is accepted")
	dir := fs.String("dir", "/var/lib/vco-sim", "state file and disk images live here")
	backend := fs.String("backend", "host", "host (sparse files, loop devices for the local VM) or bookkeeping")
	locations := fs.String("locations", "ch-lug-1,ch-gen-1,nl-ams-1", "comma-separated location names")
	vms := fs.Int("vms-per-location", 2, "plain VMs seeded per location")
	hostUUID := fs.String("host-vm-uuid", "", "reference_id of a VM standing for this machine (default: this machine's SMBIOS UUID if readable)")
	hostLoc := fs.String("host-vm-location", "", "location of that VM (default: the first)")
	latency := fs.Duration("latency", 0, "fault: latency added to every API request")
	errRate := fs.Float64("error-rate", 0, "fault: fraction of API requests answered 503")
	forbid := fs.Bool("forbid-create", false, "fault: answer 403 to disk creation")
	multi := fs.Bool("allow-multi-attach", false, "fault: let a disk be attached to two VMs")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	host, _, err := net.SplitHostPort(*listen)
	if ip := net.ParseIP(host); err != nil || ip == nil || !ip.IsLoopback() {
		fmt.Fprintf(os.Stderr, "vco-lab sim: --listen %s is not a loopback IP address; the simulator serves 127.0.0.1 only\n", *listen)
		return 2
	}
	if err := os.MkdirAll(*dir, 0o700); err != nil {
		fmt.Fprintf(os.Stderr, "vco-lab sim: %v\n", err)
		return 1
	}
	seed := sim.Seed{VMsPerLocation: *vms}
	for _, l := range strings.Split(*locations, ",") {
		if l = strings.TrimSpace(l); l != "" {
			seed.Locations = append(seed.Locations, l)
		}
	}
	seed.HostVM.ReferenceID, seed.HostVM.Location = *hostUUID, *hostLoc
	if seed.HostVM.ReferenceID == "" {
		if info, err := smbios.Read(""); err == nil {
			seed.HostVM.ReferenceID = info.UUID
		} else {
			log.Warn("no VM stands for this machine: its SMBIOS UUID is unreadable; pass --host-vm-uuid", "error", err)
		}
	}
	opts := sim.Options{Customer: *customer, StateFile: filepath.Join(*dir, "state.json"), Seed: seed, Logger: log,
		Faults: sim.Faults{Latency: sim.Duration(*latency), ErrorRate: *errRate, ForbidCreate: *forbid, AllowMultiAttach: *multi}}
	switch *backend {
	case "host":
		opts.Backend = &sim.HostBackend{Dir: filepath.Join(*dir, "disks")}
	case "bookkeeping":
		opts.Backend = sim.BookkeepingBackend{}
	default:
		fmt.Fprintf(os.Stderr, "vco-lab sim: unknown --backend %q\n", *backend)
		return 2
	}
	if *tokenFile != "" {
		b, err := os.ReadFile(*tokenFile)
		if err != nil {
			fmt.Fprintf(os.Stderr, "vco-lab sim: %v\n", err)
			return 1
		}
		opts.Token = strings.TrimSpace(string(b))
	}
	s, err := sim.New(opts)
	if err != nil {
		fmt.Fprintf(os.Stderr, "vco-lab sim: %v\n", err)
		return 1
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "vco-lab sim: %v\n", err)
		return 1
	}
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Info("simulator serving", "api", "http://"+ln.Addr().String()+"/api/1", "admin", "http://"+ln.Addr().String()+"/admin", "customer", *customer, "state", opts.StateFile)
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintf(os.Stderr, "vco-lab sim: %v\n", err)
		return 1
	}
	return 0
}
