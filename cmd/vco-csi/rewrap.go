package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/whitesky-cloud/vco-storage/crypt"
	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/csi/agentnode"
	"github.com/whitesky-cloud/vco-storage/csi/driver"
	"github.com/whitesky-cloud/vco-storage/internal/cleartext"
)

// rewrapper is what `vco-csi rewrap` needs of the agent.
type rewrapper interface {
	driver.TokenRewriter
	EncryptedVolumes(ctx context.Context) ([]string, error)
}

// runRewrap is `vco-csi rewrap [VOLUME...]`, run in a node plugin's
// container after the transit key's rotation: the token of each encrypted
// volume staged on this node (or of each one named) is rewrapped by the
// newest version of its key (driver.Rewrap). It prints a line per volume
// and exits 1 if any failed; docs/encryption.md, "Key rotation".
func runRewrap(args []string, out, errs io.Writer) int {
	fs := flag.NewFlagSet("rewrap", flag.ContinueOnError)
	fs.SetOutput(errs)
	sock := fs.String("agent-socket", "/run/vco-agent/agent.sock", "vco-agent socket")
	dir := fs.String("key-backend-dir", "/etc/vco-csi/key-backend", "the node plugin's key backend directory (its --key-backend-dir)")
	tokenFile := fs.String("vault-token-file", "", "a Vault token allowed update on <transitMount>/rewrap and /decrypt of the key, instead of the node plugin's Kubernetes login")
	insecure := fs.Bool(strings.TrimPrefix(cleartext.Option, "--"), false, "as the node plugin's flag of that name")
	fs.Usage = func() {
		fmt.Fprintln(errs, "usage: vco-csi rewrap [flags] [VOLUME...]\n\nRewraps the passphrase of each encrypted volume staged on this node (or of each VOLUME) with the newest version of its transit key.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	w, err := rewrapTransit(*dir, *tokenFile, *insecure)
	if err == nil && w == nil {
		err = fmt.Errorf("%s holds no key backend settings (csi-key-backend-config): there is nothing to rewrap with", *dir)
	}
	if err != nil {
		fmt.Fprintf(errs, "vco-csi rewrap: %v\n", err)
		return 2
	}
	a, err := agentnode.Dial(*sock, agentnode.Options{})
	if err != nil {
		fmt.Fprintf(errs, "vco-csi rewrap: %v\n", err)
		return 2
	}
	defer a.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return rewrapVolumes(ctx, a, w, fs.Args(), out, errs)
}

// rewrapTransit is the transit client of the key backend directory, with
// the token of tokenFile instead of the Kubernetes login when given.
func rewrapTransit(dir, tokenFile string, insecure bool) (crypt.Wrapper, error) {
	kb, err := loadKeyBackend(dir, insecure)
	if err != nil || kb == nil {
		return nil, err
	}
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return nil, fmt.Errorf("reading the Vault token: %w", err)
		}
		kb.Transit.Token = strings.TrimSpace(string(b))
		if kb.Transit.Token == "" {
			return nil, fmt.Errorf("the Vault token file %s is empty", tokenFile)
		}
	}
	return transit.New(kb.Transit)
}

// rewrapVolumes rewraps vols, or every encrypted volume staged here when
// none is named, printing a line for each.
func rewrapVolumes(ctx context.Context, a rewrapper, w crypt.Wrapper, vols []string, out, errs io.Writer) int {
	if len(vols) == 0 {
		var err error
		if vols, err = a.EncryptedVolumes(ctx); err != nil {
			fmt.Fprintf(errs, "vco-csi rewrap: listing the encrypted volumes staged here: %v\n", err)
			return 1
		}
		if len(vols) == 0 {
			fmt.Fprintln(out, "no encrypted volume is staged on this node")
			return 0
		}
	}
	code := 0
	for _, v := range vols {
		r, err := driver.Rewrap(ctx, a, w, v)
		switch {
		case err != nil:
			fmt.Fprintf(out, "%s: FAILED: %v\n", v, err)
			code = 1
		case r.To > r.From:
			fmt.Fprintf(out, "%s: rewrapped: transit key %s version %d -> %d\n", v, r.Key, r.From, r.To)
		default:
			fmt.Fprintf(out, "%s: already the newest: transit key %s version %d\n", v, r.Key, r.From)
		}
		if errors.Is(ctx.Err(), context.Canceled) {
			fmt.Fprintln(errs, "vco-csi rewrap: interrupted; the volumes not listed above are unchanged")
			return 1
		}
	}
	return code
}
