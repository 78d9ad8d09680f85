package e2e

import (
	"fmt"
	"slices"
	"strings"
)

// Scenario names one scenario of a story: its id (E1, K4), a name that
// says what it proves, and the safety properties it gives evidence for.
// Each story keeps one ordered list of them (the lab story's Story here,
// the Kubernetes story's in integration/k8s); the report, the
// -scenarios and -skip flags, and the docs' scenario tables are made
// from it.
type Scenario struct {
	ID    string
	Name  string
	Props []Property
}

// String is the scenario's id and name.
func (sc Scenario) String() string { return sc.ID + " " + sc.Name }

// IDs are the ids of scs, in order.
func IDs(scs []Scenario) []string {
	ids := make([]string, len(scs))
	for i, sc := range scs {
		ids[i] = sc.ID
	}
	return ids
}

// Exercised are the safety properties the scenarios of scs named by ids
// give evidence for, in the order of Properties.
func Exercised(scs []Scenario, ids []string) []Property {
	var ps []Property
	for _, p := range Properties {
		for _, sc := range scs {
			if slices.Contains(ids, sc.ID) && slices.Contains(sc.Props, p) {
				ps = append(ps, p)
				break
			}
		}
	}
	return ps
}

// Lookup finds the scenario id among scs, or says which ids there are.
func Lookup(scs []Scenario, id string) (Scenario, error) {
	for _, sc := range scs {
		if sc.ID == id {
			return sc, nil
		}
	}
	return Scenario{}, fmt.Errorf("no scenario %q (known: %s)", id, strings.Join(IDs(scs), ", "))
}

// PropsText is the properties as a docs table writes them: "P1, P5", or
// "-" for none.
func PropsText(ps []Property) string {
	if len(ps) == 0 {
		return "-"
	}
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = string(p)
	}
	return strings.Join(s, ", ")
}
