package uevent

import (
	"errors"
	"testing"
)

var diskAdd = [][2]string{
	{"ACTION", "add"}, {"DEVPATH", "/devices/pci0000:00/0000:00:07.0/virtio4/block/vdb"}, {"SUBSYSTEM", "block"},
	{"MAJOR", "252"}, {"MINOR", "16"}, {"DEVNAME", "vdb"}, {"DEVTYPE", "disk"}, {"DISKSEQ", "12"}, {"SEQNUM", "4711"},
}

func TestParseKernel(t *testing.T) {
	ev, err := Parse(encodeKernel(diskAdd))
	if err != nil {
		t.Fatal(err)
	}
	if ev.Source != Kernel || ev.Action != "add" || ev.DevPath != diskAdd[1][1] || ev.Subsystem != "block" ||
		ev.DevName != "vdb" || ev.DevType != "disk" || !ev.HasDevnum || ev.Major != 252 || ev.Minor != 16 ||
		ev.Seqnum != 4711 || ev.Env["DISKSEQ"] != "12" || !ev.Disk() || ev.Node() != "/dev/vdb" {
		t.Fatalf("parsed %+v", ev)
	}
}

func TestParseUdev(t *testing.T) {
	env := append(diskAdd[:len(diskAdd):len(diskAdd)], [2]string{"ID_SERIAL", "wsc-disk-42"}, [2]string{"SYSTEMD_READY", "0"}, [2]string{"USEC_INITIALIZED", "123"})
	ev, err := Parse(encodeUdev(env))
	if err != nil {
		t.Fatal(err)
	}
	if ev.Source != Udev || ev.Action != "add" || ev.Major != 252 || ev.Env["ID_SERIAL"] != "wsc-disk-42" || ev.Env["SYSTEMD_READY"] != "0" {
		t.Fatalf("parsed %+v", ev)
	}
}

func TestParseRejects(t *testing.T) {
	udevBadMagic := encodeUdev(diskAdd)
	udevBadMagic[9] ^= 0xff
	udevOverrun := encodeUdev(diskAdd)
	udevOverrun[20] = 0xff
	for name, b := range map[string][]byte{
		"empty":              nil,
		"no at":              []byte("add/devices/x\x00ACTION=add\x00DEVPATH=/devices/x\x00"),
		"header mismatch":    []byte("add@/devices/x\x00ACTION=remove\x00DEVPATH=/devices/x\x00"),
		"field without =":    []byte("add@/devices/x\x00ACTION=add\x00DEVPATH=/devices/x\x00JUNK\x00"),
		"major only":         []byte("add@/devices/x\x00ACTION=add\x00DEVPATH=/devices/x\x00MAJOR=8\x00"),
		"bad minor":          []byte("add@/devices/x\x00ACTION=add\x00DEVPATH=/devices/x\x00MAJOR=8\x00MINOR=x\x00"),
		"bad seqnum":         []byte("add@/devices/x\x00ACTION=add\x00DEVPATH=/devices/x\x00SEQNUM=-1\x00"),
		"udev short":         []byte("libudev\x00\xfe\xed"),
		"udev magic":         udevBadMagic,
		"udev props overrun": udevOverrun,
	} {
		if _, err := Parse(b); !errors.Is(err, ErrNotUevent) {
			t.Errorf("%s: %v", name, err)
		}
	}
}
