// Package udev holds the udev rules that the node packages install to
// /usr/lib/udev/rules.d (60-vco-agent.rules): they mark whitesky.cloud
// data disks SYSTEMD_READY=0 and UDISKS_IGNORE=1 until vco-agent has
// claimed them. The package has no code; its test runs the rules through a
// real udevadm against a real device, inside a private mount namespace so
// that nothing on the host changes.
package udev

// RulesFile is the file name, as installed.
const RulesFile = "60-vco-agent.rules"
