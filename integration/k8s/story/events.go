package story

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/k8s"
)

// waitEvent waits up to two minutes for an Event in scope (kubectl's -A
// or -n NS) matching the field selector sel of which match holds, and
// returns its type and message.
func (s *story) waitEvent(ctx context.Context, scope []string, sel string, match func(eventItem) bool) (string, error) {
	var msg string
	err := k8s.WaitFor(ctx, 2*time.Minute, "an Event with "+sel, func() (bool, string, error) {
		out, err := s.c.Kubectl(ctx, append(append([]string{"get", "events"}, scope...), "--field-selector", sel, "-o", "json")...)
		if err != nil {
			return false, err.Error(), nil
		}
		var list struct{ Items []eventItem }
		if err := json.Unmarshal([]byte(out), &list); err != nil {
			return false, err.Error(), nil
		}
		for _, it := range list.Items {
			if match(it) {
				msg = it.Type + ": " + it.Message
				return true, "", nil
			}
		}
		return false, fmt.Sprintf("%d Events with %s, none about the disk and its holder", len(list.Items), sel), nil
	})
	return msg, err
}

// eventItem is what the scenarios read of a core/v1 Event.
type eventItem struct{ Message, Type string }
