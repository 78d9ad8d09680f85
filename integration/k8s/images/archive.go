package images

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/whitesky-cloud/vco-storage/deploy/ociimage"
)

// LoadArchive reads the vco-csi image from an OCI layout archive as `make
// image` writes it (dist/vco-csi-<version>.oci.tar, one image or an index
// of several architectures) and returns its linux/amd64 image. The
// archive is unpacked under cacheDir/vco-csi/<its sha256>, which the
// image's blobs are read from; other unpacked archives there are removed.
func LoadArchive(cacheDir, archive string) (v1.Image, error) {
	f, err := os.Open(archive)
	if err != nil {
		return nil, fmt.Errorf("vco-csi image archive: %w (run `make image`)", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return nil, fmt.Errorf("reading %s: %w", archive, err)
	}
	sum := hex.EncodeToString(h.Sum(nil))[:16]
	base := filepath.Join(cacheDir, "vco-csi")
	dir := filepath.Join(base, sum)
	if _, err := os.Stat(filepath.Join(dir, "index.json")); err != nil {
		if err := os.MkdirAll(base, 0o755); err != nil {
			return nil, err
		}
		tmp, err := os.MkdirTemp(base, ".unpack-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(tmp)
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return nil, err
		}
		if err := untar(f, tmp); err != nil {
			return nil, fmt.Errorf("unpacking %s: %w", archive, err)
		}
		if err := os.Rename(tmp, dir); err != nil {
			return nil, err
		}
	}
	if old, err := os.ReadDir(base); err == nil {
		for _, e := range old {
			if e.Name() != sum && !strings.HasPrefix(e.Name(), ".") {
				os.RemoveAll(filepath.Join(base, e.Name()))
			}
		}
	}
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("%s is not an OCI image layout: %w", archive, err)
	}
	img, err := amd64Image(idx)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", archive, err)
	}
	return img, nil
}

// amd64Image finds the linux/amd64 image in an index, descending into
// nested indexes (a layout lists a multi-architecture image as one).
func amd64Image(idx v1.ImageIndex) (v1.Image, error) {
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	for _, d := range im.Manifests {
		switch {
		case d.MediaType.IsIndex():
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, err
			}
			if img, err := amd64Image(child); err == nil {
				return img, nil
			}
		case d.MediaType.IsImage():
			img, err := idx.Image(d.Digest)
			if err != nil {
				return nil, err
			}
			cf, err := img.ConfigFile()
			if err != nil {
				return nil, err
			}
			if cf.OS == "linux" && cf.Architecture == "amd64" {
				return img, nil
			}
		}
	}
	return nil, errors.New("holds no linux/amd64 image; build it with IMAGE_ARCHS including amd64")
}

// untar unpacks regular files and directories only, refusing paths that
// leave dir.
func untar(r io.Reader, dir string) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		if !strings.HasPrefix(p, filepath.Clean(dir)+string(filepath.Separator)) {
			return fmt.Errorf("entry %q leaves the archive's directory", h.Name)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			w, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
			if err != nil {
				return err
			}
			if _, err := io.Copy(w, tr); err != nil {
				w.Close()
				return err
			}
			if err := w.Close(); err != nil {
				return err
			}
		default:
			return fmt.Errorf("entry %q is neither a file nor a directory", h.Name)
		}
	}
}

// containerdName is the annotation `ctr images import` names an image by.
const containerdName = "io.containerd.image.name"

// writeLayout writes img as an OCI layout in dir, listed with its
// platform (`ctr images import` drops an image without one) and its
// reference (containerd's name annotation, and the tag as the OCI ref
// name).
func writeLayout(dir, ref string, img v1.Image) error {
	r, err := name.ParseReference(ref)
	if err != nil {
		return fmt.Errorf("image reference %q: %w", ref, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	return p.AppendImage(img,
		layout.WithAnnotations(map[string]string{containerdName: r.Name(), ociimage.RefNameAnnotation: r.Identifier()}),
		layout.WithPlatform(v1.Platform{OS: cf.OS, Architecture: cf.Architecture}))
}

// WriteArchive writes img as an OCI layout archive that `ctr -n k8s.io
// images import` loads under ref, for images a node needs before it can
// pull (containerd's sandbox_image, PauseRef).
func WriteArchive(path, ref string, img v1.Image) error {
	tmp, err := os.MkdirTemp("", "vco-lab-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if err := writeLayout(tmp, ref, img); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".image-*.tar")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if err := ociimage.TarDir(tmp, f, epoch); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}
