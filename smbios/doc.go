// Package smbios reads the node's identity (the SMBIOS system UUID,
// manufacturer, product name and serial) from sysfs, falling back to parsing
// the raw DMI table when the kernel's decoded attributes are absent.
//
// The system UUID is what the fencing key and the node's match to its cloud
// VM are derived from, so it must be exact: the byte order of the first three
// UUID fields depends on the SMBIOS version, and the firmware's "not present"
// markers (all 0x00, all 0xFF) must never become an identity.
//
// The table walker is written here rather than taken from a library: the
// format is small (an entry point and a list of type/length/handle structures
// with trailing string sets), and the Go parsers available neither decode the
// system information structure with its version-dependent UUID byte order nor
// read from an arbitrary sysfs root, which the tests need to point at a
// fixture tree.
package smbios
