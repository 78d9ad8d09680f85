package logging

import (
	"context"
	"log/slog"
	"strconv"

	sdjournal "github.com/coreos/go-systemd/v22/journal"

	"github.com/whitesky-cloud/vco-storage/agent/events"
)

// EventFields are the journal fields of an event: its type's fixed
// MESSAGE_ID and one VCO_* field per non-empty event field.
func EventFields(e events.Event) map[string]string {
	f := map[string]string{
		"MESSAGE_ID":        e.Type.MessageID(),
		"SYSLOG_IDENTIFIER": Identifier,
		"VCO_EVENT":         e.Type.String(),
		"VCO_SEQ":           strconv.FormatUint(e.Seq, 10),
	}
	put := func(k, v string) {
		if v != "" {
			f[k] = v
		}
	}
	put("VCO_VOLUME", e.Volume)
	put("VCO_DEVICE", e.Device)
	put("VCO_SERIAL", e.Serial)
	put("VCO_HOLDER_KEY", e.HolderKeyString())
	put("VCO_HOLDER_NODE", e.HolderNode)
	put("VCO_REASON", e.Reason)
	return f
}

// EventPriority is how loud each event is in the journal: a refused or
// fenced disk needs an operator, a claim or release does not.
func EventPriority(t events.Type) sdjournal.Priority {
	switch t {
	case events.DiskFenced:
		return sdjournal.PriErr
	case events.DiskRefused, events.TakeoverGranted:
		return sdjournal.PriWarning
	default:
		return sdjournal.PriNotice
	}
}

// JournalSink writes each event to the journal natively.
type JournalSink struct{}

func (JournalSink) Name() string { return "journal" }

func (JournalSink) Emit(e events.Event) error {
	return sdjournal.Send(e.Text(), EventPriority(e.Type), EventFields(e))
}

// LogSink records events through a slog logger, for hosts where the
// journal socket is absent: the same fields, in the text log.
type LogSink struct{ Log *slog.Logger }

func (LogSink) Name() string { return "log" }

func (s LogSink) Emit(e events.Event) error {
	f := EventFields(e)
	attrs := make([]any, 0, 2*len(f))
	for _, k := range []string{"VCO_EVENT", "VCO_SEQ", "VCO_VOLUME", "VCO_DEVICE", "VCO_SERIAL", "VCO_HOLDER_KEY", "VCO_HOLDER_NODE", "VCO_REASON", "MESSAGE_ID"} {
		if v, ok := f[k]; ok {
			attrs = append(attrs, k, v)
		}
	}
	lvl := slog.LevelInfo
	switch EventPriority(e.Type) {
	case sdjournal.PriErr:
		lvl = slog.LevelError
	case sdjournal.PriWarning:
		lvl = slog.LevelWarn
	}
	s.Log.Log(context.Background(), lvl, e.Text(), attrs...)
	return nil
}

// EventSink puts events where the log goes: natively into the journal
// when the agent logs there (under systemd), else into the text log, so an
// operator reading the agent's output always sees them.
func EventSink(log *slog.Logger, journal bool) events.Sink {
	if journal {
		return JournalSink{}
	}
	return LogSink{Log: log}
}
