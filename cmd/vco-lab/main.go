// Command vco-lab runs the multi-node lab: QEMU guests sharing iSCSI disks
// with real SCSI-3 reservations, the whitesky.cloud simulator, and the
// end-to-end scenarios.
package main

import (
	"fmt"
	"os"
)

// version is set at link time by the Makefile.
var version = "dev"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "version" {
		fmt.Println(version)
		return
	}
	fmt.Fprintln(os.Stderr, "vco-lab: the lab is not built yet")
	os.Exit(2)
}
