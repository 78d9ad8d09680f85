// Command pause is the lab's pod sandbox process: PID 1 of each pod's
// sandbox, holding its namespaces. It sleeps until SIGINT or SIGTERM, and
// reaps children re-parented to it (a pod sharing its PID namespace makes
// it their init). integration/k8s/images builds it into the pause image,
// as a module of its own: hence the standard library only.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
