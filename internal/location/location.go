// Package location checks a whitesky.cloud location name as a node states
// it (the agent's node.location, the controller's map of VMs to locations)
// before it becomes the node's topology label: a placeholder left from a
// template, or a value that cannot be a label, is no location.
package location

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// Placeholder is the value the cloud-init template ships for the optional
// node.location.
const Placeholder = "REPLACE-WITH-LOCATION"

// Check says why v cannot be a node's location, or nil. "" is not checked:
// it means not set.
func Check(v string) error {
	if IsPlaceholder(v) {
		return fmt.Errorf("%q is a template placeholder, not a location", v)
	}
	if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
		return fmt.Errorf("%q cannot be a location (a topology label value): %s", v, strings.Join(errs, "; "))
	}
	return nil
}

// IsPlaceholder says whether v is a template's stand-in for a value: the
// template's own, any other REPLACE-WITH-... or CHANGE-ME, or a shell or
// template variable left unexpanded.
func IsPlaceholder(v string) bool {
	u := strings.ToUpper(strings.TrimSpace(v))
	return strings.HasPrefix(u, "REPLACE-WITH") || strings.HasPrefix(u, "REPLACE_WITH") ||
		u == "CHANGEME" || u == "CHANGE-ME" || u == "TODO" ||
		strings.Contains(u, "${") || strings.HasPrefix(u, "$") || strings.Contains(u, "{{") ||
		strings.HasPrefix(u, "<")
}
