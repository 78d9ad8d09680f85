package images

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"fmt"
	"path"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/whitesky-cloud/vco-storage/deploy/ociimage"
)

// epoch stamps every file and image, so equal inputs give equal digests.
var epoch = time.Unix(0, 0).UTC()

// entry is one file of an image's single layer.
type entry struct {
	name     string // absolute path in the image
	mode     int64
	uid, gid int
	data     []byte // a regular file's content
	link     string // a symlink's target
	dir      bool
}

// rootfs holds the files of one layer; directories are added as needed.
type rootfs map[string]entry

func (r rootfs) dir(name string, mode int64) {
	r[name] = entry{name: name, mode: mode, dir: true}
}

func (r rootfs) file(name string, mode int64, data []byte) {
	r[name] = entry{name: name, mode: mode, data: data}
}

func (r rootfs) symlink(name, target string) {
	r[name] = entry{name: name, mode: 0o777, link: target}
}

// users adds /etc/passwd and /etc/group with root, the unprivileged
// user of the lab's images (ociimage's) and nobody.
func (r rootfs) users() {
	r.file("/etc/passwd", 0o644, fmt.Appendf(nil, "root:x:0:0:root:/root:/bin/sh\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n",
		ociimage.UID, ociimage.GID))
	r.file("/etc/group", 0o644, fmt.Appendf(nil, "root:x:0:\nnonroot:x:%d:\nnogroup:x:65534:\n", ociimage.GID))
	r.dir("/tmp", 0o1777)
}

func (r rootfs) tar() ([]byte, error) {
	// Parent directories first: tar order is creation order.
	for name := range r {
		for d := path.Dir(name); d != "/"; d = path.Dir(d) {
			if _, ok := r[d]; !ok {
				r.dir(d, 0o755)
			}
		}
	}
	names := make([]string, 0, len(r))
	for n := range r {
		names = append(names, n)
	}
	sort.Strings(names)
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, n := range names {
		e := r[n]
		h := &tar.Header{Name: strings.TrimPrefix(n, "/"), Mode: e.mode, Uid: e.uid, Gid: e.gid, ModTime: epoch, Format: tar.FormatPAX}
		switch {
		case e.dir:
			h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
		case e.link != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, e.link
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(e.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write(e.data); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// image is a single-layer linux/amd64 OCI image of r with config c.
func image(r rootfs, c v1.Config, comment string) (v1.Image, error) {
	data, err := r.tar()
	if err != nil {
		return nil, err
	}
	if c.WorkingDir == "" {
		c.WorkingDir = "/"
	}
	if len(c.Env) == 0 {
		c.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
	}
	return ociimage.SingleLayer(data, "amd64", epoch, c, v1.History{CreatedBy: "integration/k8s/images", Comment: comment})
}

// staticAMD64 refuses a binary the image could not run: not x86-64 ELF,
// or in need of a dynamic loader the image does not have.
func staticAMD64(name string, bin []byte) error {
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		return fmt.Errorf("%s is not an ELF executable: %w", name, err)
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 {
		return fmt.Errorf("%s is built for %v, not amd64", name, f.Machine)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked; the image has no libc", name)
		}
	}
	return nil
}
