package logging

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/agent/events"
	"github.com/whitesky-cloud/vco-storage/agent/internal/testjournal"
)

// TestMain doubles as a child process that reports whether it sees its
// stderr as a journal stream.
func TestMain(m *testing.M) {
	if os.Getenv("VCO_LOGGING_CHILD") == "1" {
		fmt.Println(StderrIsJournal())
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func childSeesJournal(t *testing.T, stderr *os.File, journalStream string) bool {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "VCO_LOGGING_CHILD=1", "JOURNAL_STREAM="+journalStream)
	cmd.Stderr = stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child: %v", err)
	}
	return strings.TrimSpace(string(out)) == "true"
}

func TestJournalStreamDetectionMatchesStderrDevIno(t *testing.T) {
	// A real unix stream socket stands in for journald's stream: what
	// matters is that JOURNAL_STREAM names the very file stderr is.
	a, b, err := socketPair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	defer b.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(a.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if !childSeesJournal(t, a, fmt.Sprintf("%d:%d", st.Dev, st.Ino)) {
		t.Error("stderr named by JOURNAL_STREAM not detected as journal stream")
	}
	if childSeesJournal(t, a, fmt.Sprintf("%d:%d", st.Dev, st.Ino+1)) {
		t.Error("a different inode was taken for the journal stream")
	}
	if childSeesJournal(t, a, "") {
		t.Error("no JOURNAL_STREAM was taken for the journal stream")
	}
}

func socketPair() (*os.File, *os.File, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		return nil, nil, err
	}
	return os.NewFile(uintptr(fds[0]), "a"), os.NewFile(uintptr(fds[1]), "b"), nil
}

func entry(t *testing.T, j *testjournal.Journal, key, val string) map[string]string {
	t.Helper()
	e := j.Wait(key, val, 5*time.Second)
	if e == nil {
		t.Fatalf("no journal entry with %s=%s; got %v", key, val, j.Entries())
	}
	return e
}

func TestJournalSinkSendsMessageIDAndFields(t *testing.T) {
	j := testjournal.Listen(t)
	e := events.Event{Type: events.DiskRefused, Seq: 7, Volume: "ch-lug-1/disk-42", Device: "/dev/sdb",
		Serial: "0QEMU_disk42", HolderKey: 0x5643aabbccddeeff, HolderNode: "node-b", Reason: "held-elsewhere",
		Message: "disk 42 is reserved by node-b\nrefusing it"}
	if err := (JournalSink{}).Emit(e); err != nil {
		t.Fatal(err)
	}
	f := entry(t, j, "VCO_SEQ", "7")
	want := map[string]string{
		"MESSAGE_ID": "4aa8a0fc1a4a92cec915055d97daeec3", "PRIORITY": "4", "SYSLOG_IDENTIFIER": "vco-agent",
		"VCO_EVENT": "DiskRefused", "VCO_SEQ": "7", "VCO_VOLUME": "ch-lug-1/disk-42", "VCO_DEVICE": "/dev/sdb",
		"VCO_SERIAL": "0QEMU_disk42", "VCO_HOLDER_KEY": "5643aabbccddeeff", "VCO_HOLDER_NODE": "node-b",
		"VCO_REASON": "held-elsewhere", "MESSAGE": "DiskRefused: disk 42 is reserved by node-b\nrefusing it",
	}
	for k, v := range want {
		if f[k] != v {
			t.Errorf("%s = %q, want %q", k, f[k], v)
		}
	}
}

func TestJournalHandlerMapsAttrsAndGroups(t *testing.T) {
	j := testjournal.Listen(t)
	log := slog.New(NewJournalHandler(slog.LevelInfo)).With("node", "n1").WithGroup("grpc")
	log.Debug("not sent")
	log.Warn("caller refused", "uid", 65534, slog.Group("peer", "pid", 12))
	f := entry(t, j, "MESSAGE", "caller refused")
	if j.Wait("MESSAGE", "not sent", 0) != nil {
		t.Error("a debug record passed an info-level handler")
	}
	want := map[string]string{"MESSAGE": "caller refused", "PRIORITY": "4", "NODE": "n1", "GRPC_UID": "65534", "GRPC_PEER_PID": "12", "SYSLOG_IDENTIFIER": "vco-agent"}
	for k, v := range want {
		if f[k] != v {
			t.Errorf("%s = %q, want %q (entry %v)", k, f[k], v, f)
		}
	}
}

func TestLogSinkWritesEventFieldsAsText(t *testing.T) {
	var buf bytes.Buffer
	s := LogSink{Log: slog.New(slog.NewTextHandler(&buf, nil))}
	_ = s.Emit(events.Event{Type: events.DiskFenced, Seq: 3, Device: "/dev/sdc", Reason: "reservation-lost"})
	out := buf.String()
	for _, w := range []string{"level=ERROR", "VCO_EVENT=DiskFenced", "VCO_DEVICE=/dev/sdc", "VCO_REASON=reservation-lost", "MESSAGE_ID=f43bb8ebcd3cedccd5bf91a8aa8e4939"} {
		if !strings.Contains(out, w) {
			t.Errorf("log line %q lacks %q", out, w)
		}
	}
	if strings.Contains(out, "VCO_VOLUME") {
		t.Errorf("empty field written: %q", out)
	}
}

func TestFieldName(t *testing.T) {
	for in, want := range map[string]string{"volume": "VOLUME", "holder-key": "HOLDER_KEY", "_x": "X", "9a": "F_9A", "": "F_"} {
		if got := FieldName(in); got != want {
			t.Errorf("FieldName(%q) = %q, want %q", in, got, want)
		}
	}
}
