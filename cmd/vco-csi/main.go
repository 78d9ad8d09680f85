// Command vco-csi is the whitesky.cloud CSI plugin. Its controller talks to
// the whitesky.cloud API; its node side delegates every privileged operation
// to vco-agent over a unix socket.
package main

import (
	"fmt"
	"os"
)

// version is set at link time by the Makefile.
var version = "dev"

func main() {
	if len(os.Args) > 1 && (os.Args[1] == "version" || os.Args[1] == "--version") {
		fmt.Println(version)
		return
	}
	fmt.Fprintln(os.Stderr, "vco-csi: the CSI plugin is not built yet; only 'vco-csi version' works")
	os.Exit(2)
}
