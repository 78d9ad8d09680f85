// Package ociimage builds the vco-csi container image without a container
// daemon and writes it as an OCI image layout in a tar archive
// (dist/vco-csi-<version>.oci.tar), which skopeo, umoci, podman, crane or
// containerd's ctr can load. go-containerregistry assembles the image; what
// is ours is the one layer: the static binary, passwd/group entries for
// the unprivileged user, and a CA bundle for the cloud API. There is no
// shell or libc: the plugin needs neither.
package ociimage

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Where things are inside the image.
const (
	BinaryPath   = "/usr/bin/vco-csi"
	CABundlePath = "/etc/ssl/certs/ca-certificates.crt"
	// UID and GID of the image's user, "nonroot" as in distroless images.
	UID = 65532
	GID = 65532
	// RefNameAnnotation names the image inside the layout; tools select
	// it with oci-archive:FILE:<version>.
	RefNameAnnotation = "org.opencontainers.image.ref.name"
)

// Options say what goes into the image.
type Options struct {
	// Version tags the image in the layout and in its labels.
	Version string
	// Binaries maps a Go architecture (amd64, arm64) to a static vco-csi
	// binary built for it.
	Binaries map[string]string
	// CABundle is a PEM file installed at CABundlePath; empty leaves the
	// image without one (the controller then needs --ca-file).
	CABundle string
	// Created stamps the image, the layout and every file, so the same
	// inputs give the same bytes.
	Created time.Time
	// Source is the org.opencontainers.image.source label.
	Source string
}

// Build returns one image per architecture, in Go architecture order.
func Build(o Options) ([]v1.Image, []string, error) {
	if o.Version == "" {
		return nil, nil, errors.New("image version is empty")
	}
	if len(o.Binaries) == 0 {
		return nil, nil, errors.New("no vco-csi binary given")
	}
	var ca []byte
	if o.CABundle != "" {
		var err error
		if ca, err = os.ReadFile(o.CABundle); err != nil {
			return nil, nil, fmt.Errorf("reading CA bundle: %w", err)
		}
	}
	var archs []string
	for a := range o.Binaries {
		archs = append(archs, a)
	}
	sort.Strings(archs)
	var imgs []v1.Image
	for _, arch := range archs {
		bin, err := os.ReadFile(o.Binaries[arch])
		if err != nil {
			return nil, nil, fmt.Errorf("reading the %s binary: %w", arch, err)
		}
		if err := checkStatic(o.Binaries[arch], bin, arch); err != nil {
			return nil, nil, err
		}
		img, err := buildOne(o, arch, bin, ca)
		if err != nil {
			return nil, nil, fmt.Errorf("%s image: %w", arch, err)
		}
		imgs = append(imgs, img)
	}
	return imgs, archs, nil
}

var goarchMachine = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

// checkStatic refuses a binary for another machine or one that needs a
// dynamic loader, which the image does not have.
func checkStatic(path string, bin []byte, arch string) error {
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		return fmt.Errorf("%s is not an ELF executable: %w", path, err)
	}
	defer f.Close()
	if m, ok := goarchMachine[arch]; !ok || f.Machine != m {
		return fmt.Errorf("%s is built for %v, not %s", path, f.Machine, arch)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked; build it with CGO_ENABLED=0", path)
		}
	}
	return nil
}

func buildOne(o Options, arch string, bin, ca []byte) (v1.Image, error) {
	rootfs, err := layerTar(o.Created, bin, ca)
	if err != nil {
		return nil, err
	}
	return SingleLayer(rootfs, arch, o.Created, v1.Config{
		User:       fmt.Sprintf("%d:%d", UID, GID),
		Entrypoint: []string{BinaryPath},
		WorkingDir: "/",
		Env:        []string{"PATH=/usr/bin", "SSL_CERT_FILE=" + CABundlePath},
		Labels: map[string]string{
			"org.opencontainers.image.title":       "vco-csi",
			"org.opencontainers.image.description": "whitesky.cloud CSI plugin (controller and unprivileged node plugin)",
			"org.opencontainers.image.version":     o.Version,
			"org.opencontainers.image.source":      o.Source,
			"org.opencontainers.image.created":     o.Created.UTC().Format(time.RFC3339),
		},
	}, v1.History{CreatedBy: "vco-addon image", Comment: "vco-csi static binary, nonroot user, CA bundle"})
}

// SingleLayer is a linux/arch OCI image (OCI media types) whose one layer
// is the tar archive rootfs, with config cfg, created at created, and one
// history entry h (its time set to created).
func SingleLayer(rootfs []byte, arch string, created time.Time, cfg v1.Config, h v1.History) (v1.Image, error) {
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(rootfs)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	if img, err = mutate.AppendLayers(img, layer); err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	cf.Created = v1.Time{Time: created}
	cf.Config = cfg
	h.Created = v1.Time{Time: created}
	cf.History = []v1.History{h}
	return mutate.ConfigFile(img, cf)
}

// layerTar is the image's only layer.
func layerTar(created time.Time, bin, ca []byte) ([]byte, error) {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755, ModTime: created, Format: tar.FormatPAX})
	}
	file := func(name string, mode int64, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: created, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", UID, GID)
	group := fmt.Sprintf("root:x:0:\nnonroot:x:%d:\n", GID)
	steps := []func() error{
		func() error { return dir("etc/") },
		func() error { return file("etc/passwd", 0o644, []byte(passwd)) },
		func() error { return file("etc/group", 0o644, []byte(group)) },
		func() error { return dir("etc/ssl/") },
		func() error { return dir("etc/ssl/certs/") },
		func() error { return dir("usr/") },
		func() error { return dir("usr/bin/") },
		func() error { return file(BinaryPath[1:], 0o755, bin) },
		// A home for the user and a writable /tmp on images run without a
		// read-only root; the manifests mount nothing here.
		func() error {
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "home/", Mode: 0o755, ModTime: created, Format: tar.FormatPAX})
		},
		func() error {
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "home/nonroot/", Mode: 0o700, Uid: UID, Gid: GID, ModTime: created, Format: tar.FormatPAX})
		},
		func() error {
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777, ModTime: created, Format: tar.FormatPAX})
		},
	}
	if ca != nil {
		steps = append(steps, func() error { return file(CABundlePath[1:], 0o644, ca) })
	}
	for _, s := range steps {
		if err := s(); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// WriteLayout writes the images as an OCI image layout in dir: one image
// is listed in index.json directly, several through an image index, in
// both cases under the ref name version.
func WriteLayout(dir, version string, imgs []v1.Image, archs []string) error {
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	ref := map[string]string{RefNameAnnotation: version}
	if len(imgs) == 1 {
		return p.AppendImage(imgs[0], layout.WithAnnotations(ref), layout.WithPlatform(v1.Platform{OS: "linux", Architecture: archs[0]}))
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for i, img := range imgs {
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			Platform: &v1.Platform{OS: "linux", Architecture: archs[i]}}})
	}
	return p.AppendIndex(idx, layout.WithAnnotations(ref))
}

// TarDir archives a directory tree (an OCI layout) with fixed owners and
// times, entries in name order, so equal trees give equal archives.
func TarDir(dir string, w io.Writer, mtime time.Time) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil || rel == "." {
			return err
		}
		rel = filepath.ToSlash(rel)
		h := &tar.Header{Name: rel, ModTime: mtime, Format: tar.FormatPAX}
		if d.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, rel+"/", 0o755
			return tw.WriteHeader(h)
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s is not a regular file", path)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		h.Typeflag, h.Mode, h.Size = tar.TypeReg, 0o644, int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err = tw.Write(data)
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// WriteArchive builds the images and writes the layout tarball to out.
func WriteArchive(o Options, out string) error {
	imgs, archs, err := Build(o)
	if err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "vco-csi-oci-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if err := WriteLayout(tmp, o.Version, imgs, archs); err != nil {
		return fmt.Errorf("writing the OCI layout: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(out), ".vco-csi-oci-*.tar")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if err := TarDir(tmp, f, o.Created); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), out)
}
