// Package ociimage builds the vco-csi container image without a container
// daemon: go-containerregistry assembles one layer (the static binary, a
// CA bundle for the cloud API, and passwd/group entries for an unprivileged
// user) per architecture, an image index over them, and writes it as an OCI
// image layout in a tar archive (dist/vco-csi-<version>.oci.tar), which any
// OCI tool can load.
package ociimage

import (
	"archive/tar"
	"bytes"
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

// The unprivileged user the image runs as (the conventional "nonroot").
const (
	UID  = 65532
	User = "nonroot"
)

// Options says what goes into the image.
type Options struct {
	// Version labels the image and names it in the layout.
	Version string
	// Binaries maps a Go architecture (amd64, arm64) to its static
	// vco-csi binary.
	Binaries map[string]string
	// CACerts is a PEM bundle installed as /etc/ssl/certs/ca-certificates.crt
	// so the controller can reach the cloud API over TLS.
	CACerts string
	// Created stamps the image and every file, for reproducible builds.
	Created time.Time
	// Source is the org.opencontainers.image.source label.
	Source string
}

// Build returns an image index with one image per architecture.
func Build(o Options) (v1.ImageIndex, error) {
	if len(o.Binaries) == 0 {
		return nil, fmt.Errorf("no binaries to put in the image")
	}
	ca, err := os.ReadFile(o.CACerts)
	if err != nil {
		return nil, fmt.Errorf("CA bundle for the image: %w", err)
	}
	arches := make([]string, 0, len(o.Binaries))
	for a := range o.Binaries {
		arches = append(arches, a)
	}
	sort.Strings(arches)

	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, arch := range arches {
		bin, err := os.ReadFile(o.Binaries[arch])
		if err != nil {
			return nil, fmt.Errorf("%s binary: %w", arch, err)
		}
		img, err := image(o, arch, bin, ca)
		if err != nil {
			return nil, fmt.Errorf("%s image: %w", arch, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add: img,
			Descriptor: v1.Descriptor{
				MediaType: types.OCIManifestSchema1,
				Platform:  &v1.Platform{OS: "linux", Architecture: arch},
			},
		})
	}
	return idx, nil
}

func image(o Options, arch string, bin, ca []byte) (v1.Image, error) {
	files := []file{
		{name: "etc/", mode: 0o755 | fs.ModeDir},
		{name: "etc/passwd", mode: 0o644, data: fmt.Appendf(nil, "root:x:0:0:root:/root:/sbin/nologin\n%s:x:%d:%d:%s:/home/%s:/sbin/nologin\n", User, UID, UID, User, User)},
		{name: "etc/group", mode: 0o644, data: fmt.Appendf(nil, "root:x:0:\n%s:x:%d:\n", User, UID)},
		{name: "etc/ssl/", mode: 0o755 | fs.ModeDir},
		{name: "etc/ssl/certs/", mode: 0o755 | fs.ModeDir},
		{name: "etc/ssl/certs/ca-certificates.crt", mode: 0o644, data: ca},
		{name: "home/", mode: 0o755 | fs.ModeDir},
		{name: "home/" + User + "/", mode: 0o700 | fs.ModeDir, uid: UID},
		{name: "tmp/", mode: 0o1777 | fs.ModeDir | fs.ModeSticky},
		{name: "usr/", mode: 0o755 | fs.ModeDir},
		{name: "usr/bin/", mode: 0o755 | fs.ModeDir},
		{name: "usr/bin/vco-csi", mode: 0o755, data: bin},
	}
	layerTar, err := tarFiles(files, o.Created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.AppendLayers(img, layer)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	cf.Created = v1.Time{Time: o.Created}
	cf.Config = v1.Config{
		User:       fmt.Sprintf("%d:%d", UID, UID),
		Entrypoint: []string{"/usr/bin/vco-csi"},
		WorkingDir: "/",
		Env:        []string{"PATH=/usr/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"},
		Labels: map[string]string{
			"org.opencontainers.image.title":   "vco-csi",
			"org.opencontainers.image.version": o.Version,
			"org.opencontainers.image.source":  o.Source,
			"org.opencontainers.image.vendor":  "whitesky.cloud",
		},
	}
	return mutate.ConfigFile(img, cf)
}

type file struct {
	name string
	mode fs.FileMode
	data []byte
	uid  int
}

func tarFiles(files []file, mtime time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := &tar.Header{
			Name:    f.name,
			Mode:    int64(f.mode.Perm()),
			ModTime: mtime,
			Uid:     f.uid,
			Gid:     f.uid,
			Format:  tar.FormatPAX,
		}
		if f.mode&fs.ModeSticky != 0 {
			h.Mode |= 0o1000
		}
		if f.mode.IsDir() {
			h.Typeflag = tar.TypeDir
		} else {
			h.Typeflag = tar.TypeReg
			h.Size = int64(len(f.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// WriteArchive writes idx as an OCI image layout, named refName
// (org.opencontainers.image.ref.name), into the tar archive out.
func WriteArchive(idx v1.ImageIndex, refName, out string, mtime time.Time) error {
	dir, err := os.MkdirTemp("", "vco-oci-layout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": refName,
	})); err != nil {
		return err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		h := &tar.Header{Name: filepath.ToSlash(rel), ModTime: mtime, Mode: 0o644, Format: tar.FormatPAX}
		if d.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", 0o755
			return tw.WriteHeader(h)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		h.Typeflag, h.Size = tar.TypeReg, int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err = tw.Write(data)
		return err
	})
	if err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	return os.WriteFile(out, buf.Bytes(), 0o644)
}
