// Package smbios reads the node's identity (the SMBIOS system UUID,
// manufacturer, product name and serial) from sysfs, falling back to parsing
// the raw DMI table when the kernel's decoded attributes are absent.
package smbios
