// Package story runs the Kubernetes lab's scenarios (K1-K14) on a
// cluster of package k8s and turns what happened into a report with a
// verdict per safety property, as package e2e does for the lab story.
// Its scenarios are one registry (All), from which -scenarios, the report
// and the table of docs/development.md ("The Kubernetes lab") are made.
package story
