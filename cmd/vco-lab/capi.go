package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/whitesky-cloud/vco-storage/integration/capi"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

const capiUsage = `usage: vco-lab capi prefetch

  prefetch
          build Cluster API's core manager from its sources
          (integration/capi/build) with the release's CRDs into the cache
          unless a build of the same inputs is there, and print the
          binary's path; make capi-prefetch runs it in the background,
          make soak-k8s-crs in the foreground
`

func capiCmd(args []string) int {
	if len(args) != 1 || args[0] != "prefetch" {
		fmt.Fprint(os.Stderr, capiUsage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	m, err := capi.Build(ctx, lab.DefaultCacheDir(), os.Stderr)
	if err != nil {
		return fail("capi prefetch: %v", err)
	}
	fmt.Fprintf(os.Stderr, "vco-lab: Cluster API's core manager is ready (%s)\n", time.Since(start).Round(time.Second))
	fmt.Println(m.Bin)
	return 0
}
