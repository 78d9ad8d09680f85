// Package logging sets up the agent's log/slog output and the event sink
// that records events in the same place. Under systemd, when stderr is the
// journal's stream, records go to the journal natively so that every
// attribute becomes a field one can filter on with journalctl; anywhere
// else they are plain text on stderr.
package logging

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"

	sdjournal "github.com/coreos/go-systemd/v22/journal"
)

// Identifier is the SYSLOG_IDENTIFIER of everything the agent sends to the
// journal.
const Identifier = "vco-agent"

// StderrIsJournal reports whether stderr is connected to the journal's
// stream transport (JOURNAL_STREAM names stderr's device and inode).
func StderrIsJournal() bool {
	ok, err := sdjournal.StderrIsJournalStream()
	return err == nil && ok
}

// New returns the agent's logger: journal-native when stderr is a journal
// stream and the journal socket answers, plain text on w otherwise. The
// second result is true for the journal.
func New(level slog.Leveler, w io.Writer) (*slog.Logger, bool) {
	if StderrIsJournal() && sdjournal.Enabled() {
		return slog.New(NewJournalHandler(level)), true
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level})), false
}

// JournalHandler is a slog.Handler that sends each record to the journal
// with its attributes as fields: key "volume" becomes VOLUME, a group "g"
// with key "k" becomes G_K.
type JournalHandler struct {
	level  slog.Leveler
	prefix string // group path as a field-name prefix, e.g. "GRPC_"
	fields map[string]string
	send   func(msg string, p sdjournal.Priority, vars map[string]string) error
	mu     *sync.Mutex
}

// NewJournalHandler sends through the system journal socket.
func NewJournalHandler(level slog.Leveler) *JournalHandler {
	return &JournalHandler{level: level, fields: map[string]string{}, send: sdjournal.Send, mu: &sync.Mutex{}}
}

func (h *JournalHandler) Enabled(_ context.Context, l slog.Level) bool {
	return l >= h.level.Level()
}

func (h *JournalHandler) Handle(_ context.Context, r slog.Record) error {
	vars := make(map[string]string, len(h.fields)+r.NumAttrs()+1)
	for k, v := range h.fields {
		vars[k] = v
	}
	vars["SYSLOG_IDENTIFIER"] = Identifier
	r.Attrs(func(a slog.Attr) bool {
		addAttr(vars, h.prefix, a)
		return true
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.send(r.Message, Priority(r.Level), vars)
}

func (h *JournalHandler) WithAttrs(as []slog.Attr) slog.Handler {
	n := *h
	n.fields = make(map[string]string, len(h.fields)+len(as))
	for k, v := range h.fields {
		n.fields[k] = v
	}
	for _, a := range as {
		addAttr(n.fields, h.prefix, a)
	}
	return &n
}

func (h *JournalHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	n := *h
	n.prefix = h.prefix + FieldName(name) + "_"
	return &n
}

func addAttr(vars map[string]string, prefix string, a slog.Attr) {
	a.Value = a.Value.Resolve()
	if a.Equal(slog.Attr{}) {
		return
	}
	if a.Value.Kind() == slog.KindGroup {
		p := prefix
		if a.Key != "" {
			p += FieldName(a.Key) + "_"
		}
		for _, g := range a.Value.Group() {
			addAttr(vars, p, g)
		}
		return
	}
	vars[prefix+FieldName(a.Key)] = a.Value.String()
}

// FieldName turns an attribute key into a valid journal field name:
// upper case letters, digits and underscores, not starting with an
// underscore or a digit (those are reserved or rejected by journald).
func FieldName(key string) string {
	var b strings.Builder
	for _, r := range key {
		switch {
		case r >= 'a' && r <= 'z':
			b.WriteRune(r - 'a' + 'A')
		case r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	s := strings.TrimLeft(b.String(), "_")
	if s == "" || (s[0] >= '0' && s[0] <= '9') {
		s = "F_" + s
	}
	return s
}

// Priority maps a slog level to a syslog priority.
func Priority(l slog.Level) sdjournal.Priority {
	switch {
	case l >= slog.LevelError:
		return sdjournal.PriErr
	case l >= slog.LevelWarn:
		return sdjournal.PriWarning
	case l >= slog.LevelInfo:
		return sdjournal.PriInfo
	default:
		return sdjournal.PriDebug
	}
}
