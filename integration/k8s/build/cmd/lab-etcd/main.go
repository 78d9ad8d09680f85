// Command lab-etcd runs the etcd server of the lab's Kubernetes control plane,
// the same server etcd ships, built from the version k8s.io/kubernetes pins.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
