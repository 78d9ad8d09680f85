package main

import "errors"

func runImage(args []string) error { return errors.New("not yet") }
