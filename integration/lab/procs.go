package lab

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Proc is a process the lab started, recorded in a pid file so that a
// later run can kill it even if the process that started it crashed. The
// start time from /proc/PID/stat is kept beside the PID so a recycled PID
// is never mistaken for ours.
type Proc struct {
	Name      string
	PID       int
	StartTime uint64
	PIDFile   string
	cmd       *exec.Cmd
	exited    chan struct{}
	exitErr   error
}

// procStartTime reads field 22 of /proc/PID/stat (start time in clock
// ticks since boot).
func procStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state); start time is field 22.
	if len(f) < 20 {
		return 0, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	f := strings.Fields(s[i+1:])
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// startProc starts cmd in its own process group (so a Ctrl-C meant for the
// lab does not kill it behind the lab's back; the lab tears down itself)
// and writes its pid file into pidDir.
func startProc(name string, cmd *exec.Cmd, pidDir string) (*Proc, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s (%s): %w", name, cmd.Path, err)
	}
	p := &Proc{Name: name, PID: cmd.Process.Pid, cmd: cmd, exited: make(chan struct{})}
	p.StartTime, _ = procStartTime(p.PID)
	go func() {
		p.exitErr = cmd.Wait()
		close(p.exited)
	}()
	if err := os.MkdirAll(pidDir, 0o755); err != nil {
		p.Kill()
		return nil, err
	}
	p.PIDFile = filepath.Join(pidDir, name+".pid")
	if err := os.WriteFile(p.PIDFile, fmt.Appendf(nil, "%d %d %s\n", p.PID, p.StartTime, cmd.Path), 0o644); err != nil {
		p.Kill()
		return nil, err
	}
	return p, nil
}

// Exited is closed when a process started by this process ends.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// Kill sends SIGKILL (tgtd ignores SIGTERM, and a guest has nothing to
// save) to the recorded process, waits until it is gone, and removes its
// pid file. It is safe to call more than once.
func (p *Proc) Kill() error {
	err := killRecorded(p.PID, p.StartTime, p.exited)
	if err == nil && p.PIDFile != "" {
		_ = os.Remove(p.PIDFile)
	}
	return err
}

// killRecorded kills pid if it is still the process that started at
// startTime, and waits for it to disappear (exited is non-nil when this
// process is its parent and reaps it).
func killRecorded(pid int, startTime uint64, exited <-chan struct{}) error {
	st, err := procStartTime(pid)
	if err != nil || (startTime != 0 && st != startTime) {
		return nil // gone, or the PID now belongs to someone else
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("killing pid %d: %w", pid, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if exited != nil {
			select {
			case <-exited:
				return nil
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		st, err := procStartTime(pid)
		if err != nil || st != startTime || procState(pid) == "Z" {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("pid %d still present 30s after SIGKILL", pid)
}

// KillPIDFiles kills every process recorded in pidDir that is still the
// recorded process, and removes the pid files. It is how `vco-lab down`
// cleans up after a run that crashed.
func KillPIDFiles(pidDir string) (killed []string, err error) {
	files, _ := filepath.Glob(filepath.Join(pidDir, "*.pid"))
	var errs []error
	for _, f := range files {
		b, rerr := os.ReadFile(f)
		if rerr != nil {
			continue
		}
		var pid int
		var start uint64
		var path string
		if _, serr := fmt.Sscanf(string(b), "%d %d %s", &pid, &start, &path); serr != nil || pid <= 1 {
			errs = append(errs, fmt.Errorf("pid file %s is malformed; remove it by hand after checking: %q", f, b))
			continue
		}
		if st, serr := procStartTime(pid); serr == nil && st == start {
			if kerr := killRecorded(pid, start, nil); kerr != nil {
				errs = append(errs, kerr)
				continue
			}
			killed = append(killed, fmt.Sprintf("%s (pid %d)", strings.TrimSuffix(filepath.Base(f), ".pid"), pid))
		}
		_ = os.Remove(f)
	}
	return killed, errors.Join(errs...)
}

// Alive reports whether pid is running and started at startTime.
func Alive(pid int, startTime uint64) bool {
	st, err := procStartTime(pid)
	return err == nil && st == startTime && procState(pid) != "Z"
}
