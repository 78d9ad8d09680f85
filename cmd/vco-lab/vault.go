package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/lab"
	"github.com/whitesky-cloud/vco-storage/integration/vault"
)

const vaultUsage = `usage: vco-lab vault prefetch

  prefetch
          build the Vault server from its sources (integration/vault/build)
          into the cache unless a build of the same inputs is there, and
          print the binary's path; make vault-prefetch runs it in the
          background, make test-vault in the foreground
`

func vaultCmd(args []string) int {
	return prefetchCmd(args, vaultUsage, "vault", "the Vault server", func(ctx context.Context) (string, error) {
		return vault.Build(ctx, lab.DefaultCacheDir(), os.Stderr)
	})
}

// prefetchCmd is `vco-lab NAME prefetch`: build, cached, what build makes
// (what names it) and print the binary's path; usage for anything else.
func prefetchCmd(args []string, usage, name, what string, build func(context.Context) (string, error)) int {
	if len(args) != 1 || args[0] != "prefetch" {
		fmt.Fprint(os.Stderr, usage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	bin, err := build(ctx)
	if err != nil {
		return fail("%s prefetch: %v", name, err)
	}
	fmt.Fprintf(os.Stderr, "vco-lab: %s is ready (%s)\n", what, time.Since(start).Round(time.Second))
	fmt.Println(bin)
	return 0
}
