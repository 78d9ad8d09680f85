package main

import (
	"os"

	"github.com/whitesky-cloud/vco-storage/agent/daemon"
)

func runServe(args []string) int { return daemon.Main(args, version, os.Stderr) }
