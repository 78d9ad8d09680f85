// Command vco-csi is the whitesky.cloud CSI plugin. Its controller talks to
// the whitesky.cloud API; its node side delegates every privileged operation
// to vco-agent over a unix socket. `vco-csi plugin-dirs` gives the node
// plugin its host directories; `vco-csi rewrap` rewraps the encrypted
// volumes' passphrases after the transit key's rotation. (The API simulator is `vco-lab sim`.)
package main

import (
	"fmt"
	"os"
)

// version is set at link time by the Makefile.
var version = "dev"

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "version", "--version":
			fmt.Println(version)
			return
		case "plugin-dirs":
			os.Exit(runPluginDirs(os.Args[2:], os.Stdout, os.Stderr))
		case "rewrap":
			os.Exit(runRewrap(os.Args[2:], os.Stdout, os.Stderr))
		}
	}
	os.Exit(runPlugin(os.Args[1:]))
}
