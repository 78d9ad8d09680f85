package images

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"sort"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// Registry is an OCI registry on loopback, in this process.
type Registry struct {
	// Host is host:port, e.g. 127.0.0.1:5000; a guest on QEMU user
	// networking reaches it as 10.0.2.2:<port>.
	Host string
	// URL is http://<Host>, what containerd's mirror endpoint names.
	URL string

	srv   *http.Server
	blobs string
	done  chan struct{}
}

// Serve starts a registry on addr (loopback only; port 0 picks one),
// pushes imgs into it under their references' repository paths
// (registry.k8s.io/sig-storage/csi-attacher:v4.13.0 is served as
// <Host>/sig-storage/csi-attacher:v4.13.0) and serves until ctx ends or
// Stop. Blobs are kept in a temporary directory, removed by Stop.
func Serve(ctx context.Context, addr string, imgs map[string]v1.Image) (*Registry, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("registry address %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return nil, fmt.Errorf("registry address %q is not a loopback IP; the lab's registry serves nothing beyond this machine", addr)
	}
	blobs, err := os.MkdirTemp("", "vco-lab-registry-")
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		os.RemoveAll(blobs)
		return nil, fmt.Errorf("registry: %w", err)
	}
	r := &Registry{Host: ln.Addr().String(), blobs: blobs, done: make(chan struct{})}
	r.URL = "http://" + r.Host
	r.srv = &http.Server{
		Handler:           registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithBlobHandler(registry.NewDiskBlobHandler(blobs))),
		ReadHeaderTimeout: 10 * time.Second,
	}
	go func() {
		defer close(r.done)
		if err := r.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Printf("lab registry on %s: %v", r.Host, err)
		}
	}()
	go func() {
		select {
		case <-ctx.Done():
			r.Stop()
		case <-r.done:
		}
	}()
	refs := make([]string, 0, len(imgs))
	for ref := range imgs {
		refs = append(refs, ref)
	}
	sort.Strings(refs)
	for _, ref := range refs {
		if err := r.Push(ctx, ref, imgs[ref]); err != nil {
			r.Stop()
			return nil, err
		}
	}
	return r, nil
}

// Ref is where the registry serves ref: its repository path and tag (or
// digest) under Host.
func (r *Registry) Ref(ref string) (name.Reference, error) {
	p, err := name.ParseReference(ref)
	if err != nil {
		return nil, fmt.Errorf("image reference %q: %w", ref, err)
	}
	return name.ParseReference(r.Host+"/"+p.Context().RepositoryStr()+refSuffix(p), name.Insecure)
}

func refSuffix(p name.Reference) string {
	if d, ok := p.(name.Digest); ok {
		return "@" + d.DigestStr()
	}
	return ":" + p.Identifier()
}

// Push adds img under ref's repository path, e.g. the vco-csi image
// under the name the add-on is rendered with.
func (r *Registry) Push(ctx context.Context, ref string, img v1.Image) error {
	dst, err := r.Ref(ref)
	if err != nil {
		return err
	}
	if err := remote.Write(dst, img, remote.WithContext(ctx)); err != nil {
		return fmt.Errorf("pushing %s to the lab registry as %s: %w", ref, dst, err)
	}
	return nil
}

// Stop stops serving and removes the blobs. It may be called more than
// once.
func (r *Registry) Stop() {
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r.srv.Shutdown(sctx)
	<-r.done
	os.RemoveAll(r.blobs)
}
