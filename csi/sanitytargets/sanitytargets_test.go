package sanitytargets

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// node records the paths it is given; it stands in for the plugin, whose
// own tests are elsewhere.
type node struct {
	csi.UnimplementedNodeServer
	got []string
}

func (n *node) NodePublishVolume(_ context.Context, r *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	n.got = append(n.got, r.TargetPath, r.StagingTargetPath)
	return &csi.NodePublishVolumeResponse{}, nil
}

func (n *node) NodeGetVolumeStats(_ context.Context, r *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	n.got = append(n.got, r.VolumePath)
	return nil, status.Errorf(codes.NotFound, "volume %s is not at %s", r.VolumeId, r.VolumePath)
}

func TestProxyMovesTargetsToTheKubeletsShape(t *testing.T) {
	dir := t.TempDir()
	n := &node{}
	srv := grpc.NewServer()
	csi.RegisterNodeServer(srv, n)
	back, err := net.Listen("unix", filepath.Join(dir, "plugin.sock"))
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(back)
	t.Cleanup(srv.Stop)
	front, err := net.Listen("unix", filepath.Join(dir, "proxy.sock"))
	if err != nil {
		t.Fatal(err)
	}
	tg := Targets{Kubelet: "/k", Dir: "/k/sanity"}
	stop, err := tg.Proxy(front, "unix://"+filepath.Join(dir, "plugin.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "proxy.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := csi.NewNodeClient(conn)
	ctx := context.Background()

	if _, err := c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", TargetPath: "/k/sanity/target", StagingTargetPath: "/k/sanity/target"}); err != nil {
		t.Fatal(err)
	}
	_, err = c.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: "/k/sanity"})
	if status.Code(err) != codes.NotFound || status.Convert(err).Message() != "volume v is not at /k/sanity" {
		t.Fatalf("the plugin's error came back as %v", err)
	}
	want := []string{"/k/pods/target/volumes/kubernetes.io~csi/sanity/mount", "/k/sanity/target", "/k/sanity"}
	if len(n.got) != len(want) {
		t.Fatalf("the plugin got %q, want %q", n.got, want)
	}
	for i := range want {
		if n.got[i] != want[i] {
			t.Errorf("the plugin got %q, want %q", n.got, want)
		}
	}
	if _, err := c.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{}); status.Code(err) != codes.Unimplemented {
		t.Errorf("a call the plugin does not serve: %v", err)
	}
}

// The interceptor moves a copy; csi-sanity's own request is left as it was.
func TestInterceptorLeavesTheCallersRequest(t *testing.T) {
	tg := Targets{Kubelet: "/k", Dir: "/k/sanity"}
	req := &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: "/k/sanity/other_target"}
	var sent any
	err := tg.Interceptor()(context.Background(), "/csi.v1.Node/NodeUnpublishVolume", req, nil, nil,
		func(_ context.Context, _ string, r, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
			sent = r
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	if got := sent.(*csi.NodeUnpublishVolumeRequest).TargetPath; got != "/k/pods/other_target/volumes/kubernetes.io~csi/sanity/mount" {
		t.Errorf("sent %s", got)
	}
	if req.TargetPath != "/k/sanity/other_target" {
		t.Errorf("the caller's request was changed to %s", req.TargetPath)
	}
}

// Kind and the script csi-sanity runs say the same of a moved target and
// of any other path.
func TestKindAndCheckScriptLookAtTheMovedTarget(t *testing.T) {
	root := t.TempDir()
	tg := Targets{Kubelet: filepath.Join(root, "kubelet"), Dir: filepath.Join(root, "kubelet", "sanity")}
	if err := os.MkdirAll(tg.Path(filepath.Join(tg.Dir, "target")), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tg.Kubelet, "file"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(root, "check")
	if err := os.WriteFile(script, []byte(tg.CheckScript()), 0o700); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{
		filepath.Join(tg.Dir, "target"):       "directory",
		filepath.Join(tg.Dir, "other_target"): "not_found",
		filepath.Join(tg.Kubelet, "file"):     "file",
		tg.Dir:                                "not_found",
		filepath.Join(tg.Dir, "target", "x"):  "not_found",
	} {
		if got, err := tg.Kind(p); err != nil || got != want {
			t.Errorf("Kind(%s) = %q, %v; want %q", p, got, err, want)
		}
		out, err := exec.Command(script, p).Output()
		if got := strings.TrimSpace(string(out)); err != nil || got != want {
			t.Errorf("the script on %s says %q, %v; want %q", p, got, err, want)
		}
	}
}
