//go:build linux && (amd64 || arm64)

package scsi

import (
	"context"
	"errors"
	"os"
	"testing"
	"unsafe"
)

func TestSgIOHdrLayout(t *testing.T) {
	// struct sg_io_hdr on LP64 Linux is 88 bytes, with the pointers at
	// offsets 16, 24, 32 and usr_ptr at 56 (include/scsi/sg.h).
	var h sgIOHdr
	if s := unsafe.Sizeof(h); s != 88 {
		t.Fatalf("sizeof = %d", s)
	}
	for name, got := range map[string]uintptr{
		"dxferp": unsafe.Offsetof(h.dxferp), "cmdp": unsafe.Offsetof(h.cmdp), "sbp": unsafe.Offsetof(h.sbp),
		"timeout": unsafe.Offsetof(h.timeout), "usr_ptr": unsafe.Offsetof(h.usrPtr), "status": unsafe.Offsetof(h.status),
		"host_status": unsafe.Offsetof(h.hostStatus), "resid": unsafe.Offsetof(h.resid), "info": unsafe.Offsetof(h.info),
	} {
		want := map[string]uintptr{"dxferp": 16, "cmdp": 24, "sbp": 32, "timeout": 40, "usr_ptr": 56, "status": 64,
			"host_status": 68, "resid": 72, "info": 80}[name]
		if got != want {
			t.Errorf("offset of %s = %d, want %d", name, got, want)
		}
	}
}

func TestSGIOOnNonSCSIFile(t *testing.T) {
	// A regular file has no SG_IO: the transport must say "not SCSI", which
	// is how virtio-blk looks too.
	f, err := os.CreateTemp(t.TempDir(), "disk")
	if err != nil {
		t.Fatal(err)
	}
	s, err := OpenSGIO(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	err = NewDevice(f.Name(), s).TestUnitReady(context.Background())
	if !errors.Is(err, ErrNotSCSI) {
		t.Fatalf("SG_IO on a regular file: %v", err)
	}
}
