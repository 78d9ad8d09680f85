package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/whitesky-cloud/vco-storage/agent/client"
)

// stdout and stderr are variables so the CLI's tests can capture them.
var (
	stdout io.Writer = os.Stdout
	stderr io.Writer = os.Stderr
)

// clientFlags are the flags every client subcommand takes.
type clientFlags struct {
	fs     *flag.FlagSet
	socket string
	json   bool
}

func newClientFlags(name, summary string) *clientFlags {
	f := &clientFlags{fs: flag.NewFlagSet(name, flag.ContinueOnError)}
	f.fs.SetOutput(stderr)
	f.fs.StringVar(&f.socket, "socket", client.DefaultSocket, "the agent's API socket")
	f.fs.BoolVar(&f.json, "json", false, "print JSON instead of text")
	f.fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: vco-agent %s [flags]\n\n%s\n\nflags:\n", name, summary)
		f.fs.PrintDefaults()
	}
	return f
}

// parse returns -1 to go on, or the exit code to return now.
func (f *clientFlags) parse(args []string) int {
	if err := f.fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return 0
		}
		return 2
	}
	if f.fs.NArg() > 0 {
		fmt.Fprintf(stderr, "vco-agent %s: unexpected argument %q\n", f.fs.Name(), f.fs.Arg(0))
		return 2
	}
	return -1
}

// ask runs a command that makes one call of the agent: it parses args,
// dials the agent at --socket and makes the call within timeout. The
// answer is printed as JSON with --json, else by show, which may ask the
// agent more within the same ctx. It returns the command's exit code.
func ask[R proto.Message](f *clientFlags, args []string, timeout time.Duration,
	call func(context.Context, *client.Client) (R, error), show func(context.Context, *client.Client, R)) int {
	if code := f.parse(args); code >= 0 {
		return code
	}
	c, err := client.Dial(f.socket)
	if err != nil {
		return fail(f.fs.Name(), err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	r, err := call(ctx, c)
	if err != nil {
		return fail(f.fs.Name(), apiError(f.socket, err))
	}
	if f.json {
		fmt.Fprintln(stdout, string(protoJSON(r)))
		return 0
	}
	show(ctx, c, r)
	return 0
}

var pj = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}

func protoJSON(m proto.Message) json.RawMessage {
	b, err := pj.Marshal(m)
	if err != nil {
		// Marshalling our own messages cannot fail; keep the output valid.
		return json.RawMessage(`null`)
	}
	return b
}

func printJSON(v any) {
	b, _ := json.Marshal(v)
	fmt.Fprintln(stdout, string(b))
}

// fail prints err as the command's one line of error output.
func fail(cmd string, err error) int {
	fmt.Fprintf(stderr, "vco-agent %s: %s\n", cmd, strings.ReplaceAll(err.Error(), "\n", " "))
	return 1
}

// apiError is a failed call as a sentence: the agent's own message and the
// status code, without the gRPC wrapping.
func apiError(socket string, err error) error {
	s := status.Convert(err)
	return fmt.Errorf("the agent at %s answered %s: %s", socket, s.Code(), s.Message())
}

// parseInterleaved parses args with fs, letting flags come before, between
// or after the positional arguments, which it returns in order.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}
