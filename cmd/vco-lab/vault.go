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
	if len(args) != 1 || args[0] != "prefetch" {
		fmt.Fprint(os.Stderr, vaultUsage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	bin, err := vault.Build(ctx, lab.DefaultCacheDir(), os.Stderr)
	if err != nil {
		return fail("vault prefetch: %v", err)
	}
	fmt.Fprintf(os.Stderr, "vco-lab: the Vault server is ready (%s)\n", time.Since(start).Round(time.Second))
	fmt.Println(bin)
	return 0
}
