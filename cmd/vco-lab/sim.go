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
	f := &simFlags{}
	f.define(fs)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	opts, code, err := f.options(log)
	if err != nil {
		fmt.Fprintf(os.Stderr, "vco-lab sim: %v\n", err)
		return code
	}
	s, err := sim.New(opts)
	if err != nil {
		fmt.Fprintf(os.Stderr, "vco-lab sim: %v\n", err)
		return 1
	}
	if err := serveUntilSignal(s, f.listen, func(addr string) {
		log.Info("simulator serving", "api", "http://"+addr+"/api/1", "admin", "http://"+addr+"/admin", "customer", f.customer, "state", opts.StateFile)
	}); err != nil {
		fmt.Fprintf(os.Stderr, "vco-lab sim: %v\n", err)
		return 1
	}
	return 0
}

// simFlags are vco-lab sim's flags.
type simFlags struct {
	listen, customer, tokenFile, dir, backend, locations, hostUUID, hostLoc string
	vms                                                                     int
	latency                                                                 time.Duration
	errRate                                                                 float64
	forbid, multi                                                           bool
}

func (f *simFlags) define(fs *flag.FlagSet) {
	fs.StringVar(&f.listen, "listen", "127.0.0.1:8480", "loopback address to serve on")
	fs.StringVar(&f.customer, "customer", "acme", "customer id the simulator answers for")
	fs.StringVar(&f.tokenFile, "token-file", "", "if set, only the Bearer credential in this file is accepted")
	fs.StringVar(&f.dir, "dir", "/var/lib/vco-sim", "state file and disk images live here")
	fs.StringVar(&f.backend, "backend", "host", "host (sparse files, loop devices for the local VM) or bookkeeping")
	fs.StringVar(&f.locations, "locations", "ch-lug-1,ch-gen-1,nl-ams-1", "comma-separated location names")
	fs.IntVar(&f.vms, "vms-per-location", 2, "plain VMs seeded per location")
	fs.StringVar(&f.hostUUID, "host-vm-uuid", "", "reference_id of a VM standing for this machine (default: this machine's SMBIOS UUID if readable)")
	fs.StringVar(&f.hostLoc, "host-vm-location", "", "location of that VM (default: the first)")
	fs.DurationVar(&f.latency, "latency", 0, "fault: latency added to every API request")
	fs.Float64Var(&f.errRate, "error-rate", 0, "fault: fraction of API requests answered 503")
	fs.BoolVar(&f.forbid, "forbid-create", false, "fault: answer 403 to disk creation")
	fs.BoolVar(&f.multi, "allow-multi-attach", false, "fault: let a disk be attached to two VMs")
}

// options are the simulator's options the flags say, and the exit code
// of a refusal (2: a bad flag, 1: the machine refused).
func (f *simFlags) options(log *slog.Logger) (sim.Options, int, error) {
	host, _, err := net.SplitHostPort(f.listen)
	if ip := net.ParseIP(host); err != nil || ip == nil || !ip.IsLoopback() {
		return sim.Options{}, 2, fmt.Errorf("--listen %s is not a loopback IP address; the simulator serves 127.0.0.1 only", f.listen)
	}
	if err := os.MkdirAll(f.dir, 0o700); err != nil {
		return sim.Options{}, 1, err
	}
	seed := sim.Seed{VMsPerLocation: f.vms}
	for _, l := range strings.Split(f.locations, ",") {
		if l = strings.TrimSpace(l); l != "" {
			seed.Locations = append(seed.Locations, l)
		}
	}
	seed.HostVM.ReferenceID, seed.HostVM.Location = f.hostUUID, f.hostLoc
	if seed.HostVM.ReferenceID == "" {
		if info, err := smbios.Read(""); err == nil {
			seed.HostVM.ReferenceID = info.UUID
		} else {
			log.Warn("no VM stands for this machine: its SMBIOS UUID is unreadable; pass --host-vm-uuid", "error", err)
		}
	}
	opts := sim.Options{Customer: f.customer, StateFile: filepath.Join(f.dir, "state.json"), Seed: seed, Logger: log,
		Faults: sim.Faults{Latency: sim.Duration(f.latency), ErrorRate: f.errRate, ForbidCreate: f.forbid, AllowMultiAttach: f.multi}}
	switch f.backend {
	case "host":
		opts.Backend = &sim.HostBackend{Dir: filepath.Join(f.dir, "disks")}
	case "bookkeeping":
		opts.Backend = sim.BookkeepingBackend{}
	default:
		return opts, 2, fmt.Errorf("unknown --backend %q", f.backend)
	}
	if f.tokenFile != "" {
		b, err := os.ReadFile(f.tokenFile)
		if err != nil {
			return opts, 1, err
		}
		opts.Token = strings.TrimSpace(string(b))
	}
	return opts, 0, nil
}

// serveUntilSignal serves h on the TCP address listen until SIGINT or
// SIGTERM, calling serving with the address once it listens.
func serveUntilSignal(h http.Handler, listen string, serving func(addr string)) error {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	serving(ln.Addr().String())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
