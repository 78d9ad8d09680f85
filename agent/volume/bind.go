package volume

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/whitesky-cloud/vco-storage/agent/agenterr"
)

// bindBeneath makes a publication on the node: a bind mount of the
// mounted staging path source (or of the device node source onto a file,
// block) at target. Both ends are held as descriptors opened beneath the
// kubelet root without following symlinks (the device node lives under
// /dev, which nobody under the kubelet root can change), and the mount is
// made between them (bindAt). A target the call created is removed again
// when the mount fails, so no stray directory or file is left for
// Unpublish to refuse.
func bindBeneath(root, source, target string, block bool, opts []string) error {
	_, existed := os.Lstat(target)
	var src, dst *os.File
	var err error
	if block {
		if dst, err = createBeneath(root, target, 0o600); err != nil {
			return fmt.Errorf("creating the block target file %s: %w", target, err)
		}
		// /dev/mapper's names are symlinks to the dm-N nodes, followed here.
		fd, oerr := unix.Open(source, unix.O_PATH|unix.O_CLOEXEC, 0)
		if oerr != nil {
			err = agenterr.New(agenterr.FailedPrecondition, "opening its device %s: %v", source, oerr)
		} else {
			src = os.NewFile(uintptr(fd), source)
		}
	} else {
		if dst, err = mkdirBeneath(root, target, 0o750); err != nil {
			return fmt.Errorf("creating the target directory %s: %w", target, err)
		}
		if src, err = openBeneath(root, source, unix.O_PATH|unix.O_DIRECTORY); err == nil {
			if mp, merr := isMountRoot(src); merr != nil {
				err = merr
			} else if !mp {
				err = agenterr.New(agenterr.FailedPrecondition, "the staging path %s is not mounted; stage the volume again", source)
			}
		}
	}
	defer dst.Close()
	if src != nil {
		defer src.Close()
	}
	if err == nil {
		if err = bindAt(src, dst, opts); err != nil {
			err = agenterr.New(agenterr.Internal, "bind-mounting %s at %s: %v", src.Name(), target, err)
		}
	}
	if err != nil && existed != nil {
		if rerr := removeBeneath(root, target); rerr != nil {
			err = fmt.Errorf("%w (and the target it made could not be removed: %v)", err, rerr)
		}
	}
	return err
}
