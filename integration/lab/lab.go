// Package lab runs the multi-node test lab: Linux guests under QEMU (TCG)
// that share iSCSI disks served by tgtd on 127.0.0.1, so that SCSI-3
// persistent reservations, dm-crypt and udev are exercised on real kernels
// on a host that has neither SCSI nor device-mapper.
//
// A Lab fetches and caches a Debian guest kernel, builds an initramfs of
// busybox, the kernel modules the lab needs, sg3-utils and the static
// binaries under test, starts tgtd with LUNs on sparse files, boots guests
// with distinct SMBIOS UUIDs and iSCSI initiator names, hot-plugs disks
// through QMP, and runs commands in the guests over a virtio-serial port
// (package guestexec). Nothing in it sends traffic anywhere but loopback.
//
// Every process it starts is recorded in a pid file under the lab
// directory and killed by PID on Close, on SIGINT/SIGTERM, and (when the
// lab is not detached) when the process that started it dies; KillPIDFiles
// cleans up after a run that crashed anyway.
package lab

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// Config sets up a Lab.
type Config struct {
	// Dir holds the lab's state: pid files, sockets, logs, LUN backing
	// files, the initramfs and state.json.
	Dir string
	// CacheDir holds the guest kernel (DefaultCacheDir if empty).
	CacheDir string
	// Binaries maps guest paths to static host binaries to put in the
	// initramfs; it must include the exec server.
	Binaries map[string]string
	// ExecServer is the guest command that serves the exec channel.
	ExecServer []string
	// Modules and HostTools default to DefaultModules and DefaultHostTools.
	Modules   []string
	HostTools []string
	// Detached labs outlive the process that made them (vco-lab up);
	// otherwise guests and tgtd get SIGKILL when this process dies.
	Detached bool
}

// Lab is a running lab.
type Lab struct {
	cfg     Config
	Kernel  *Kernel
	Initrd  string
	Target  *Target
	LUNs    []*LUN
	Guests  []*Guest
	spawn   spawner
	started time.Time

	mu     sync.Mutex
	closed bool
}

// PIDDir is where a lab in dir keeps its pid files.
func PIDDir(dir string) string { return filepath.Join(dir, "pids") }

// New prepares the kernel and initramfs and starts tgtd. It kills the
// leftovers of an earlier run in the same directory first.
func New(ctx context.Context, cfg Config) (_ *Lab, err error) {
	if cfg.Dir == "" {
		return nil, errors.New("lab: no directory given")
	}
	if cfg.CacheDir == "" {
		cfg.CacheDir = DefaultCacheDir()
	}
	if cfg.Modules == nil {
		cfg.Modules = DefaultModules
	}
	if cfg.HostTools == nil {
		cfg.HostTools = DefaultHostTools
	}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, err
	}
	if killed, err := Down(cfg.Dir); err != nil {
		return nil, fmt.Errorf("cleaning up an earlier lab in %s: %w", cfg.Dir, err)
	} else if len(killed) > 0 {
		fmt.Fprintf(os.Stderr, "lab: killed leftovers of an earlier run in %s: %v\n", cfg.Dir, killed)
	}
	l := &Lab{cfg: cfg, started: time.Now(), spawn: newSpawner(!cfg.Detached)}
	register(l)
	defer func() {
		if err != nil {
			l.Close()
		}
	}()
	unlock, err := lockFile(filepath.Join(cfg.CacheDir, "lock"))
	if err != nil {
		return nil, err
	}
	l.Kernel, err = EnsureKernel(ctx, cfg.CacheDir)
	unlock()
	if err != nil {
		return nil, err
	}
	l.Initrd = filepath.Join(cfg.Dir, "initramfs.cpio")
	err = BuildInitramfs(ctx, InitramfsSpec{
		Kernel: l.Kernel, Modules: cfg.Modules, Binaries: cfg.Binaries,
		ExecServer: cfg.ExecServer, HostTools: cfg.HostTools,
	}, l.Initrd)
	if err != nil {
		return nil, err
	}
	l.Target, err = startTarget(ctx, cfg.Dir, l.spawn)
	if err != nil {
		return nil, err
	}
	return l, l.saveState()
}

// Dir is the lab directory.
func (l *Lab) Dir() string { return l.cfg.Dir }

// SetupTime is the time from New until now (call it once the guests are up).
func (l *Lab) SetupTime() time.Duration { return time.Since(l.started) }

// AddLUN creates a LUN named name (also its serial) of size bytes.
func (l *Lab) AddLUN(ctx context.Context, name string, size int64) (*LUN, error) {
	iqn := "iqn.2026-11.cloud.whitesky.lab:" + name
	lun, err := l.Target.AddLUN(ctx, iqn, filepath.Join(l.cfg.Dir, name+".img"), size, name, "vcolab-"+name)
	if err != nil {
		return nil, err
	}
	l.LUNs = append(l.LUNs, lun)
	return lun, l.saveState()
}

// NodeUUID is the SMBIOS UUID the lab gives a guest: derived from its
// name, so a node's fence key is the same in every run.
func NodeUUID(name string) string {
	h := sha256.Sum256([]byte("vco-lab node " + name))
	h[6] = h[6]&0x0f | 0x40
	h[8] = h[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

// Initiator is the iSCSI initiator name the lab gives a guest.
func Initiator(name string) string { return "iqn.2026-11.cloud.whitesky.lab.node:" + name }

// StartGuests boots the guests in parallel and waits until each one's exec
// server answers. Name is required; UUID, Initiator, MemMB and CPUs default.
func (l *Lab) StartGuests(ctx context.Context, cfgs ...GuestConfig) ([]*Guest, error) {
	guests := make([]*Guest, len(cfgs))
	errs := make([]error, len(cfgs))
	var wg sync.WaitGroup
	for i, c := range cfgs {
		if c.UUID == "" {
			c.UUID = NodeUUID(c.Name)
		}
		if c.Initiator == "" {
			c.Initiator = Initiator(c.Name)
		}
		if c.MemMB == 0 {
			c.MemMB = 384
		}
		if c.CPUs == 0 {
			c.CPUs = 1
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			dir := filepath.Join(l.cfg.Dir, c.Name)
			guests[i], errs[i] = bootRetrying(ctx, dir, func() (*Guest, error) {
				return startGuest(ctx, c, l.Kernel, l.Initrd, dir, PIDDir(l.cfg.Dir), l.spawn)
			})
		}()
	}
	wg.Wait()
	var ok []*Guest
	for _, g := range guests {
		if g != nil {
			ok = append(ok, g)
		}
	}
	l.mu.Lock()
	l.Guests = append(l.Guests, ok...)
	l.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return guests, l.saveState()
}

// Spawn starts cmd as one of the lab's processes: recorded in a pid file,
// killed on Close and, unless the lab is detached, when this process dies.
func (l *Lab) Spawn(name string, cmd *exec.Cmd) (*Proc, error) {
	return l.spawn.start(name, cmd, PIDDir(l.cfg.Dir))
}

// Guest returns the running guest with the given name.
func (l *Lab) Guest(name string) *Guest {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, g := range l.Guests {
		if g.Name == name {
			return g
		}
	}
	return nil
}

// Close kills every guest and tgtd by recorded PID and removes tgtd's
// control socket. It is safe to call more than once and from a signal
// handler's goroutine.
func (l *Lab) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	guests := l.Guests
	l.mu.Unlock()
	var errs []error
	for _, g := range guests {
		if err := g.Stop(); err != nil {
			errs = append(errs, fmt.Errorf("stopping guest %s: %w", g.Name, err))
		}
	}
	if l.Target != nil {
		if err := l.Target.Stop(); err != nil {
			errs = append(errs, fmt.Errorf("stopping tgtd: %w", err))
		}
	}
	// Anything recorded but not held (a guest that failed half-way).
	if _, err := KillPIDFiles(PIDDir(l.cfg.Dir)); err != nil {
		errs = append(errs, err)
	}
	_ = os.Remove(filepath.Join(l.cfg.Dir, "state.json"))
	unregister(l)
	return errors.Join(errs...)
}

// State is what state.json records, for `vco-lab status|exec|down` in a
// later process.
type State struct {
	TargetCtlPort int          `json:"target_ctl_port"`
	Portal        string       `json:"portal"`
	TargetPID     int          `json:"target_pid"`
	LUNs          []*LUN       `json:"luns"`
	Guests        []GuestState `json:"guests"`
}

// GuestState is one guest in state.json.
type GuestState struct {
	Name       string `json:"name"`
	UUID       string `json:"uuid"`
	Initiator  string `json:"initiator"`
	PID        int    `json:"pid"`
	StartTime  uint64 `json:"start_time"`
	QMPSocket  string `json:"qmp_socket"`
	ExecSocket string `json:"exec_socket"`
	Console    string `json:"console"`
	BootTime   string `json:"boot_time"`
}

func (l *Lab) saveState() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := State{LUNs: l.LUNs}
	if l.Target != nil {
		s.TargetCtlPort, s.Portal, s.TargetPID = l.Target.CtlPort, l.Target.Portal(), l.Target.Proc.PID
	}
	for _, g := range l.Guests {
		s.Guests = append(s.Guests, GuestState{
			Name: g.Name, UUID: g.UUID, Initiator: g.Initiator, PID: g.Proc.PID, StartTime: g.Proc.StartTime,
			QMPSocket: g.QMPSocket, ExecSocket: g.ExecSocket, Console: g.Console, BootTime: g.BootTime.Round(time.Millisecond).String(),
		})
	}
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(l.cfg.Dir, "state.json.tmp")
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(l.cfg.Dir, "state.json"))
}

// ReadState reads the state.json of the lab in dir.
func ReadState(dir string) (*State, error) {
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		return nil, fmt.Errorf("no lab running in %s (%w); start one with 'vco-lab up'", dir, err)
	}
	var s State
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("lab state %s: %w", filepath.Join(dir, "state.json"), err)
	}
	return &s, nil
}

// Down kills whatever a lab in dir left running, by its pid files, and
// removes tgtd's control socket and the state file. It returns what it
// killed.
func Down(dir string) ([]string, error) {
	s, _ := ReadState(dir)
	killed, err := KillPIDFiles(PIDDir(dir))
	if s != nil {
		removeCtlSocket(s.TargetCtlPort)
	}
	if err == nil {
		_ = os.Remove(filepath.Join(dir, "state.json"))
	}
	return killed, err
}

// KindDir is where a run over several disk kinds keeps the lab of kind k:
// each kind gets a target and guests of its own under the run's directory.
func KindDir(dir string, k DiskKind) string { return filepath.Join(dir, string(k)) }

// DownRun is Down for the directory of a whole run: the lab in dir itself
// and the lab of each disk kind under it (KindDir), so an interrupted
// `vco-lab run` is cleaned up from the directory it was given.
func DownRun(dir string) ([]string, error) {
	killed, err := Down(dir)
	errs := []error{err}
	for _, k := range []DiskKind{SCSIBlock, SCSIHD, VirtioBlk} {
		kd := KindDir(dir, k)
		if _, serr := os.Stat(kd); serr != nil {
			continue
		}
		more, err := Down(kd)
		killed = append(killed, more...)
		errs = append(errs, err)
	}
	return killed, errors.Join(errs...)
}

// lockFile takes an exclusive flock on path, so two labs do not unpack the
// kernel into the cache at the same time.
// LockFile takes an exclusive flock on path (created if missing), waiting
// for it; the returned function releases it. Caches shared by concurrent
// runs are built under one.
func LockFile(path string) (func(), error) { return lockFile(path) }

func lockFile(path string) (func(), error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
}

// spawner starts processes. When the lab is tied to this process it starts
// them from one OS thread that is locked and never exits, with
// PR_SET_PDEATHSIG: the kernel delivers that signal when the creating
// thread ends, so a single long-lived thread makes it mean "when this
// process dies" -- which covers a test binary killed by its -timeout,
// where no cleanup code runs.
type spawner struct {
	reqs chan spawnReq
}

type spawnReq struct {
	name   string
	cmd    *exec.Cmd
	pidDir string
	reply  chan spawnReply
}

type spawnReply struct {
	p   *Proc
	err error
}

var (
	sharedSpawnerOnce sync.Once
	sharedSpawner     spawner
)

func newSpawner(tied bool) spawner {
	if !tied {
		return spawner{}
	}
	sharedSpawnerOnce.Do(func() {
		sharedSpawner = spawner{reqs: make(chan spawnReq)}
		go func() {
			runtime.LockOSThread() // never unlocked: the thread lives as long as the process
			for r := range sharedSpawner.reqs {
				p, err := startProc(r.name, r.cmd, r.pidDir)
				r.reply <- spawnReply{p, err}
			}
		}()
	})
	return sharedSpawner
}

func (s spawner) start(name string, cmd *exec.Cmd, pidDir string) (*Proc, error) {
	if s.reqs == nil {
		return startProc(name, cmd, pidDir)
	}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	reply := make(chan spawnReply, 1)
	s.reqs <- spawnReq{name, cmd, pidDir, reply}
	r := <-reply
	return r.p, r.err
}

// Live labs, torn down by the signal handler.
var (
	liveMu     sync.Mutex
	live       = map[*Lab]bool{}
	signalOnce sync.Once
)

func register(l *Lab) {
	liveMu.Lock()
	live[l] = true
	liveMu.Unlock()
	signalOnce.Do(func() {
		ch := make(chan os.Signal, 1)
		signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
		go func() {
			sig := <-ch
			fmt.Fprintf(os.Stderr, "lab: %v: tearing down\n", sig)
			CloseAll()
			os.Exit(130)
		}()
	})
}

func unregister(l *Lab) {
	liveMu.Lock()
	delete(live, l)
	liveMu.Unlock()
}

// CloseAll closes every lab this process has open.
func CloseAll() {
	liveMu.Lock()
	var ls []*Lab
	for l := range live {
		ls = append(ls, l)
	}
	liveMu.Unlock()
	for _, l := range ls {
		if err := l.Close(); err != nil {
			fmt.Fprintf(os.Stderr, "lab: teardown of %s: %v\n", l.cfg.Dir, err)
		}
	}
}
