package main

import (
	"context"
	"os"

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
	return prefetchCmd(args, capiUsage, "capi", "Cluster API's core manager", func(ctx context.Context) (string, error) {
		m, err := capi.Build(ctx, lab.DefaultCacheDir(), os.Stderr)
		return m.Bin, err
	})
}
