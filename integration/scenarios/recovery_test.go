package scenarios

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/whitesky-cloud/vco-storage/crypt/transit"
	"github.com/whitesky-cloud/vco-storage/crypt/transit/transittest"
	"github.com/whitesky-cloud/vco-storage/integration/lab"
)

// The commands of docs/recovery.md the rescue guest runs on an encrypted,
// lease-fenced volume, word for word: the test assembles its guest scripts
// from these strings and checks that the page still has each of them as a
// line of its own (a trailing "# comment" aside).
const (
	rbIdentity  = `RESCUE_UUID=$(vco-agent identity --json | jq -r .identity.system_uuid)`
	rbLeaseShow = `vco-agent lease show $DEV`
	rbAcquire   = `vco-agent lease acquire $DEV --uuid $RESCUE_UUID`
	rbMapRO     = `LOOP=$(losetup --find --show --read-only --offset 1048576 $DEV)`
	rbMapRW     = `LOOP=$(losetup --find --show --offset 1048576 $DEV)`
	rbToken     = `vco-agent luks dump --json $LOOP | jq '.metadata.tokens[] | select(.type == "vco-transit")'`
	rbCT        = `CT=$(vco-agent luks dump --json $LOOP | jq -r '.metadata.tokens[] | select(.type == "vco-transit") | .ciphertext')`
	rbKey       = `KEY=$(vco-agent luks dump --json $LOOP | jq -r '.metadata.tokens[] | select(.type == "vco-transit") | .key_name')`
	rbMount     = `MOUNT=$(vco-agent luks dump --json $LOOP | jq -r '.metadata.tokens[] | select(.type == "vco-transit") | .mount // "transit"')`
	rbUmask     = `umask 077`
	rbDecrypt   = `bao write -field=plaintext "$MOUNT/decrypt/$KEY" ciphertext="$CT" | base64 -d > /run/vco-rescue.key`
	rbOpenRO    = `vco-agent luks open $LOOP vco-rescue --passphrase-file /run/vco-rescue.key --readonly`
	rbOpenRW    = `vco-agent luks open $LOOP vco-rescue --passphrase-file /run/vco-rescue.key`
	rbShred     = `shred -u /run/vco-rescue.key`
	rbMountRO   = `mount -o ro /dev/mapper/vco-rescue /mnt`
	rbNoload    = `mount -o ro,noload /dev/mapper/vco-rescue /mnt`
	rbUmount    = `umount /mnt`
	rbClose     = `vco-agent luks close vco-rescue`
	rbUnmap     = `losetup -d $LOOP`
	rbRelease   = `vco-agent lease release $DEV --uuid $RESCUE_UUID`
)

// The commands of the reservation path, on a scsi-block disk with PR.
const (
	rbFenceShow    = `vco-agent fence show $DEV`
	rbFenceAcquire = `vco-agent fence acquire $DEV --disk ams1/4711 --grant '{"disk":"ams1/4711","node":"'$RESCUE_UUID'","supersedes":["'$HOLDER_KEY'"]}'`
	rbMountDev     = `mount -o ro $DEV /mnt`
	rbFenceRelease = `vco-agent fence release $DEV`
)

var guestRunbook = []string{rbIdentity, rbLeaseShow, rbAcquire, rbMapRO, rbMapRW, rbToken, rbCT, rbKey, rbMount,
	rbUmask, rbDecrypt, rbOpenRO, rbOpenRW, rbShred, rbMountRO, rbNoload, rbUmount, rbClose, rbUnmap, rbRelease,
	rbFenceShow, rbFenceAcquire, rbMountDev, rbFenceRelease}

// runbookLines are the lines of docs/recovery.md, each without a trailing
// "# comment" and surrounding blanks.
func runbookLines(t *testing.T) map[string]bool {
	t.Helper()
	b, err := os.ReadFile("../../docs/recovery.md")
	if err != nil {
		t.Fatal(err)
	}
	lines := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	for sc.Scan() {
		l := sc.Text()
		if i := strings.Index(l, "  #"); i >= 0 {
			l = l[:i]
		}
		lines[strings.TrimSpace(l)] = true
	}
	return lines
}

const (
	rescueVol     = "vol-rescue"
	rescuePRVol   = "vol-rescue-pr"
	rescuePRData  = "written by node-a on the disk with PR"
	rescueSerial  = "4711"
	rescueBefore  = "written by node-a, checkpointed"
	rescueLast    = "written by node-a just before it died"
	rescueEnvFile = "/run/rescue.env"
)

// rescueRun is the state of TestRecoveryRunbookInGuest.
type rescueRun struct {
	l            *lab.Lab
	img          string
	lun          *lab.LUN
	node, rescue *lab.Guest
	vault        *transittest.Fake
	srvURL       string
	tc           *transit.Client
	wrapped      transit.Ciphertext
	dataSum      [32]byte
}

// TestRecoveryRunbookInGuest follows docs/recovery.md in the lab, with the
// encryption step that needs the guest kernel's dm-crypt. node-a's agent
// stages an encrypted volume on a virtio-blk disk fenced by the on-disk
// lease (LUKS2 behind the lease area, the passphrase wrapped by the transit
// engine in the header's token, as the node plugin has it done), writes two
// files (the first checkpointed by a freeze, the second only synced) and
// dies holding the lease: its VM is killed, and the disk then appears on
// a rescue guest with another SMBIOS identity that is no cluster node and
// runs no agent. The rescue runs the runbook's commands word for word:
// identity, lease show, lease acquire (held in the background while it
// works, taking over once the dead holder's expiry bound has passed), the
// read-only mapping at byte 1048576, the vco-transit token read with jq,
// the transit decrypt, luks open --readonly; `mount -o ro` refuses the
// dead node's ext4 on the read-only mapping (its journal needs a replay),
// `mount -o ro,noload` shows the checkpointed file and nothing of the
// volume's data is written; then the writable mapping, whose `mount -o ro`
// replays the journal and shows the last file too; then step 7 hands the
// disk back released. Last, node-a boots again and its agent stages the
// volume with the passphrase unwrapped from the token, formatting nothing,
// and both files are there.
//
// No Vault or OpenBao can run here: the transit engine is the FAKE one of
// package transittest, and the `bao` CLI is stood in for by a shell
// function in the rescue guest. The test reads the token's ciphertext, key
// and mount that the runbook's jq lines found, makes the call `bao write`
// would make against the fake engine from the host, and has the function
// print the engine's plaintext field (base64) when, and only when, it is
// called with exactly the runbook's arguments for those values; the rest
// of the decrypt line (umask, base64 -d, the key file) runs as written.
func TestRecoveryRunbookInGuest(t *testing.T) {
	lines := runbookLines(t)
	for _, c := range guestRunbook {
		if !lines[c] {
			t.Errorf("docs/recovery.md has no line %q", c)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	r := newRescueRun(t, ctx)
	r.nodeStagesAndDies(t, ctx)
	dev := r.attachToRescue(t, ctx)
	r.rescueTakesTheLease(t, ctx, dev)
	r.rescueReadsReadOnly(t, ctx)
	r.rescueReplaysAndReads(t, ctx)
	r.rescueHandsBack(t, ctx)
	r.rescueReservation(t, ctx)
	r.nodeRestages(t, ctx)
	t.Logf("the runbook in guests took %s in all", time.Since(start).Round(time.Second))
}

func newRescueRun(t *testing.T, ctx context.Context) *rescueRun {
	t.Helper()
	l := agentLabWith(t, ctx, "/usr/bin/jq")
	r := &rescueRun{l: l, img: filepath.Join(l.Dir(), "rescue-disk.img")}
	if err := os.WriteFile(r.img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(r.img, 128<<20); err != nil {
		t.Fatal(err)
	}
	var err error
	if r.lun, err = l.AddLUN(ctx, "rescue-pr", 64<<20); err != nil {
		t.Fatal(err)
	}
	gs, err := l.StartGuests(ctx,
		lab.GuestConfig{Name: "node-a", MemMB: 512, Disks: []lab.Disk{r.disk(), r.prDisk()}},
		lab.GuestConfig{Name: "rescue", MemMB: 512})
	if err != nil {
		t.Fatal(err)
	}
	r.node, r.rescue = gs[0], gs[1]
	r.vault = transittest.New()
	r.vault.Rotate("vco-volumes")
	r.vault.StaticToken("hvs.lab")
	srv := httptest.NewServer(r.vault)
	t.Cleanup(srv.Close)
	r.srvURL = srv.URL
	r.tc, err = transit.New(transit.Config{Address: srv.URL, Token: "hvs.lab"})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *rescueRun) disk() lab.Disk {
	return lab.Disk{ID: "rescue-disk", Kind: lab.VirtioBlk, File: r.img, Serial: rescueSerial}
}

// prDisk is the LUN of the reservation path, as a scsi-block disk.
func (r *rescueRun) prDisk() lab.Disk {
	return lab.Disk{ID: "rescue-pr", Kind: lab.SCSIBlock, LUN: r.lun}
}

// mustSh runs script in g and fails t unless it exits 0.
func mustSh(t *testing.T, ctx context.Context, g *lab.Guest, script string) string {
	t.Helper()
	out, err := g.MustSh(ctx, script)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// rescueSh runs script in the rescue guest with the variables the earlier
// steps kept (DEV, RESCUE_UUID, LOOP, CT, KEY, MOUNT), as one operator's
// shell would have them. The guest's shell is busybox's, which runs its own
// applets before anything on PATH; its losetup knows no long options, so
// losetup is util-linux's (a host tool of the lab), as on a rescue VM.
func (r *rescueRun) rescueSh(t *testing.T, ctx context.Context, script string) string {
	t.Helper()
	return mustSh(t, ctx, r.rescue, "set -eo pipefail\nlosetup() { /usr/sbin/losetup \"$@\"; }\n. "+rescueEnvFile+"\n"+script)
}

// nodeStagesAndDies: node-a's agent formats and stages the encrypted
// volume as the node plugin has it do, two files are written, and node-a's
// VM is killed with the volume mounted and the lease held.
func (r *rescueRun) nodeStagesAndDies(t *testing.T, ctx context.Context) {
	t.Helper()
	g := r.node
	if _, err := g.WaitDiskBySerial(ctx, rescueSerial); err != nil {
		t.Fatal(err)
	}
	startAgent(t, ctx, g)
	raw := make([]byte, 32)
	rand.Read(raw)
	pass := base64.RawStdEncoding.EncodeToString(raw)
	var err error
	if r.wrapped, err = r.tc.Encrypt(ctx, "vco-volumes", []byte(pass)); err != nil {
		t.Fatal(err)
	}
	mustSh(t, ctx, g, fmt.Sprintf("printf %%s '%s' > /run/pw && printf %%s '%s' > /run/wrapped", pass, r.wrapped.Text))
	var st stageReply
	if err := agentJSON(ctx, g, &st, "volume", "stage", rescueVol, "--serial", rescueSerial, "--staging", stagingOf(rescueVol),
		"--passphrase-file", "/run/pw", "--format-if-blank", "--wrapped-file", "/run/wrapped",
		"--transit-key", "vco-volumes", "--transit-key-version", strconv.Itoa(r.wrapped.Version)); err != nil ||
		!st.Formatted || st.Fencing != "FENCING_METHOD_DISK_LEASE" || st.Device != "/dev/mapper/vco-"+rescueVol {
		t.Fatalf("node-a's first stage: %+v %v", st, err)
	}
	s := stagingOf(rescueVol)
	// The freeze makes ext4 write its journal home (a checkpoint); the
	// second file is only committed to the journal by the sync.
	mustSh(t, ctx, g, fmt.Sprintf("printf %%s '%s' > %s/before.txt && sync && fsfreeze --freeze %s && fsfreeze --unfreeze %s && printf %%s '%s' > %s/last.txt && sync",
		rescueBefore, s, s, s, rescueLast, s))
	if _, err := g.WaitDiskBySerial(ctx, r.lun.Serial); err != nil {
		t.Fatal(err)
	}
	if st, err := stage(ctx, g, rescuePRVol, r.lun.Serial); err != nil || st.Fencing != "FENCING_METHOD_SCSI3_PR" {
		t.Fatalf("node-a's stage of the volume on the disk with PR: %+v %v", st, err)
	}
	if err := writeFile(ctx, g, rescuePRVol, "pr.txt", "'"+rescuePRData+"'"); err != nil {
		t.Fatal(err)
	}
	if err := g.Stop(); err != nil {
		t.Fatal(err)
	}
	t.Logf("node-a died holding the lease with %s staged (%s)", rescueVol, st.Device)
}

// dataSum is the SHA-256 of the volume's data on the disk: everything
// after the lease area.
func (r *rescueRun) dataSumNow(t *testing.T) [32]byte {
	t.Helper()
	b, err := os.ReadFile(r.img)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b[leaseData:])
}

// attachToRescue: the platform attaches the dead node's disk to the
// rescue VM. lsblk finds a disk's serial through udev, which the lab's
// guests do not run: the test finds DEV by its serial in sysfs instead.
func (r *rescueRun) attachToRescue(t *testing.T, ctx context.Context) string {
	t.Helper()
	r.dataSum = r.dataSumNow(t)
	if err := r.rescue.AttachDisk(ctx, r.disk()); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	d, err := r.rescue.WaitDiskBySerial(wctx, rescueSerial)
	if err != nil {
		t.Fatal(err)
	}
	return "/dev/" + d.Name
}

// rescueTakesTheLease: identity and lease show (step 3), then lease
// acquire held in the background (step 4) until it owns the lease.
func (r *rescueRun) rescueTakesTheLease(t *testing.T, ctx context.Context, dev string) {
	t.Helper()
	out := mustSh(t, ctx, r.rescue, fmt.Sprintf("set -e\necho DEV=%s > %s\n%s\necho RESCUE_UUID=$RESCUE_UUID >> %s\necho $RESCUE_UUID\n. %s\n%s",
		dev, rescueEnvFile, rbIdentity, rescueEnvFile, rescueEnvFile, rbLeaseShow))
	t.Logf("rescue: %s\n%s", rbLeaseShow, out)
	if !strings.HasPrefix(out, r.rescue.UUID+"\n") {
		t.Fatalf("RESCUE_UUID from vco-agent identity is not the rescue VM's SMBIOS UUID %s:\n%s", r.rescue.UUID, out)
	}
	if !strings.Contains(out, "owner:      key "+keyOf(r.node)+" (node node-a)") {
		t.Fatalf("lease show does not name node-a (key %s) as the holder:\n%s", keyOf(r.node), out)
	}
	began := time.Now()
	r.rescueSh(t, ctx, fmt.Sprintf("( set +e; %s & echo $! > /run/acquire.pid; wait $!; echo $? > /run/acquire.exit ) >/run/acquire.log 2>&1 </dev/null &", rbAcquire))
	r.rescueSh(t, ctx, `i=0; until vco-agent lease check $DEV --uuid $RESCUE_UUID >/dev/null 2>&1; do
	if [ -e /run/acquire.exit ]; then echo "lease acquire ended:"; cat /run/acquire.log; exit 1; fi
	i=$((i+1)); [ $i -lt 600 ] || { echo "the rescue did not take the lease:"; cat /run/acquire.log; exit 1; }; sleep 0.5; done`)
	took := time.Since(began)
	t.Logf("rescue: %s took the lease over from the dead holder in %s", rbAcquire, took.Round(time.Second))
	// node-a's agent ran with F = 8s: a dead holder is waited out, not
	// preempted at once.
	if took < 8*time.Second {
		t.Fatalf("the rescue took the lease in %s, less than the dead holder's fail bound", took)
	}
	out = r.rescueSh(t, ctx, rbLeaseShow)
	if !strings.Contains(out, "owner:      key "+keyOf(r.rescue)+" (node rescue)") {
		t.Fatalf("lease show does not name the rescue as the owner:\n%s", out)
	}
}

// rescueToken maps the data read-only and reads the vco-transit token with
// the runbook's jq lines (steps 5 and 6); it checks what they found and
// puts the bao stand-in into the guest.
func (r *rescueRun) rescueToken(t *testing.T, ctx context.Context, mapLine string) {
	t.Helper()
	out := r.rescueSh(t, ctx, strings.Join([]string{mapLine, "echo LOOP=$LOOP >> " + rescueEnvFile,
		rbToken, rbCT, rbKey, rbMount,
		`printf "CT='%s'\nKEY='%s'\nMOUNT='%s'\n" "$CT" "$KEY" "$MOUNT" >> ` + rescueEnvFile}, "\n"))
	t.Logf("rescue: the vco-transit token:\n%s", out)
	vars := strings.Split(r.rescueSh(t, ctx, `printf '%s\n' "$CT" "$KEY" "$MOUNT"`), "\n")
	if len(vars) != 3 || vars[0] != r.wrapped.Text || vars[1] != "vco-volumes" || vars[2] != "transit" {
		t.Fatalf("the runbook's jq lines found CT, KEY, MOUNT = %q; want %q, vco-volumes, transit", vars, r.wrapped.Text)
	}
	// What `bao write -field=plaintext "$MOUNT/decrypt/$KEY"
	// ciphertext="$CT"` prints: the engine's plaintext field, base64.
	tc, err := transit.New(transit.Config{Address: r.srvURL, Token: "hvs.lab", Mount: vars[2]})
	if err != nil {
		t.Fatal(err)
	}
	pt, err := tc.Decrypt(ctx, vars[1], vars[0])
	if err != nil {
		t.Fatal(err)
	}
	r.rescueSh(t, ctx, fmt.Sprintf(`cat > /run/bao.sh <<'EOF'
bao() {
	[ "$*" = "write -field=plaintext $MOUNT/decrypt/$KEY ciphertext=$CT" ] || { echo "bao stand-in: not the runbook's call: bao $*" >&2; return 1; }
	printf %%s '%s'
}
EOF`, base64.StdEncoding.EncodeToString(pt)))
}

// rescueKey runs the runbook's decrypt line and checks the key file is
// the owner's alone.
func (r *rescueRun) rescueKey(t *testing.T, ctx context.Context) string {
	t.Helper()
	return r.rescueSh(t, ctx, ". /run/bao.sh\n"+rbUmask+"\n"+rbDecrypt+"\nstat -c %a /run/vco-rescue.key")
}

// rescueReadsReadOnly: the read-only path of steps 5 and 6 on the dead
// node's ext4, which writes nothing of the volume's data.
func (r *rescueRun) rescueReadsReadOnly(t *testing.T, ctx context.Context) {
	t.Helper()
	r.rescueToken(t, ctx, rbMapRO)
	if mode := r.rescueKey(t, ctx); mode != "600" {
		t.Fatalf("the key file has mode %s after umask 077, want 600", mode)
	}
	out := r.rescueSh(t, ctx, strings.Join([]string{rbOpenRO, rbShred, "test ! -e /run/vco-rescue.key", "blockdev --getro /dev/mapper/vco-rescue"}, "\n"))
	if !strings.HasSuffix(out, "\n1") {
		t.Fatalf("luks open --readonly: the mapping is not read-only:\n%s", out)
	}
	// ext4 of a node that died needs its journal replayed, which a
	// read-only mapping cannot take.
	res, err := r.rescue.Sh(ctx, "set -e\n"+rbMountRO)
	if err != nil {
		t.Fatal(err)
	}
	if res.Exit == 0 {
		t.Fatalf("%s mounted the dead node's ext4 on the read-only mapping; docs/recovery.md says it refuses", rbMountRO)
	}
	dm := r.rescueSh(t, ctx, "dmesg | grep -i ext4 | tail -n 3")
	t.Logf("rescue: %s refused, as the runbook says: %s\n%s", rbMountRO, strings.TrimSpace(res.Stderr), dm)
	out = r.rescueSh(t, ctx, rbNoload+"\ncat /mnt/before.txt; echo\ncat /mnt/last.txt 2>/dev/null || echo '(not there)'\n! touch /mnt/x 2>/dev/null")
	if !strings.HasPrefix(out, rescueBefore+"\n") {
		t.Fatalf("the rescue reads no checkpointed file with noload:\n%s", out)
	}
	t.Logf("rescue: %s: before.txt read; last.txt (only in the journal, so not promised): %s", rbNoload, strings.SplitN(out, "\n", 2)[1])
	r.rescueSh(t, ctx, strings.Join([]string{rbUmount, rbClose, rbUnmap}, "\n"))
	if r.dataSumNow(t) != r.dataSum {
		t.Fatal("the read-only steps changed the volume's data on the disk")
	}
}

// rescueReplaysAndReads: the writable mapping, with the lease held, lets
// `mount -o ro` replay the journal; the last file is there.
func (r *rescueRun) rescueReplaysAndReads(t *testing.T, ctx context.Context) {
	t.Helper()
	r.rescueToken(t, ctx, rbMapRW)
	if mode := r.rescueKey(t, ctx); mode != "600" {
		t.Fatalf("the key file has mode %s after umask 077, want 600", mode)
	}
	out := r.rescueSh(t, ctx, strings.Join([]string{rbOpenRW, rbShred, "test ! -e /run/vco-rescue.key", rbMountRO,
		"cat /mnt/before.txt; echo; cat /mnt/last.txt; echo", "! touch /mnt/x 2>/dev/null"}, "\n"))
	if !strings.HasSuffix(out, rescueBefore+"\n"+rescueLast) {
		t.Fatalf("after the journal's replay the rescue does not read both files:\n%s", out)
	}
	t.Logf("rescue: %s on the writable mapping replayed the journal; both files read", rbMountRO)
}

// rescueHandsBack: step 7, with the running lease acquire stopped as
// Ctrl-C stops it; the disk then leaves the rescue VM.
func (r *rescueRun) rescueHandsBack(t *testing.T, ctx context.Context) {
	t.Helper()
	out := r.rescueSh(t, ctx, strings.Join([]string{rbUmount, rbClose, rbUnmap,
		`kill -INT $(cat /run/acquire.pid)`,
		`i=0; until [ -e /run/acquire.exit ]; do i=$((i+1)); [ $i -lt 300 ] || { echo "lease acquire did not end"; exit 1; }; sleep 0.1; done`,
		`echo "acquire exit $(cat /run/acquire.exit)"`, rbRelease, rbLeaseShow}, "\n"))
	t.Logf("rescue: step 7:\n%s", out)
	if !strings.Contains(out, "acquire exit 0\n") {
		t.Fatalf("lease acquire did not end with 0 on Ctrl-C:\n%s\n%s", out, r.rescueSh(t, ctx, "cat /run/acquire.log"))
	}
	show := out[max(strings.LastIndex(out, "device:"), 0):]
	if !strings.Contains(show, "owner:      none") || strings.Contains(show, " held epoch") ||
		!strings.Contains(show, `node "rescue" released epoch`) {
		t.Fatalf("the rescue did not hand the disk back with its slot released and no slot held:\n%s", show)
	}
	if r.rescueSh(t, ctx, "ls /dev/mapper; losetup -a") != "control" {
		t.Fatal("the rescue left a mapping or a loop device behind")
	}
	if err := r.rescue.DetachDisk(ctx, r.disk().ID); err != nil {
		t.Fatal(err)
	}
}

// hasLine reports whether a line of out contains every one of subs.
func hasLine(out string, subs ...string) bool {
	for _, l := range strings.Split(out, "\n") {
		all := true
		for _, s := range subs {
			all = all && strings.Contains(l, s)
		}
		if all {
			return true
		}
	}
	return false
}

// rescueReservation: the reservation path of steps 3, 4, 5 and 7 on the
// dead node's disk with PR: fence show names node-a's key as the holder,
// fence acquire with a grant naming it preempts it, `mount -o ro $DEV`
// replays the journal under the rescue's reservation and reads the file,
// fence release leaves no key of the rescue registered.
func (r *rescueRun) rescueReservation(t *testing.T, ctx context.Context) {
	t.Helper()
	if err := r.rescue.AttachDisk(ctx, r.prDisk()); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	d, err := r.rescue.WaitDiskBySerial(wctx, r.lun.Serial)
	if err != nil {
		t.Fatal(err)
	}
	pr := func(script string) string {
		t.Helper()
		return r.rescueSh(t, ctx, "DEV=/dev/"+d.Name+"\n"+script)
	}
	holder, rescue := keyOf(r.node), keyOf(r.rescue)
	out := pr(rbFenceShow)
	t.Logf("rescue: %s\n%s", rbFenceShow, out)
	if !hasLine(out, holder, "[holder]") {
		t.Fatalf("fence show does not name node-a's key %s as the holder:\n%s", holder, out)
	}
	out = pr("HOLDER_KEY=" + holder + "\n" + rbFenceAcquire)
	t.Logf("rescue: %s\n%s", rbFenceAcquire, out)
	if out = pr(rbFenceShow); strings.Contains(out, holder) || !hasLine(out, rescue, "[holder]") {
		t.Fatalf("after fence acquire with the grant the rescue does not hold the disk alone:\n%s", out)
	}
	if out := pr(rbMountDev + "\ncat /mnt/pr.txt\n" + rbUmount); out != rescuePRData {
		t.Fatalf("the rescue reads %q on the disk with PR", out)
	}
	out = pr(rbFenceRelease + "\n" + rbFenceShow)
	if !strings.Contains(out, "keys:         none registered") {
		t.Fatalf("after fence release a key is still registered:\n%s", out)
	}
	if err := r.rescue.DetachDisk(ctx, r.prDisk().ID); err != nil {
		t.Fatal(err)
	}
}

// nodeBStagesPR: another node stages the volume on the disk with PR after
// the rescue: the rescue's key is gone, there is nothing to preempt.
// (node-b, not node-a rebooted: in the lab a guest booted again with the
// same iSCSI initiator name lost the LUN's session, which is the lab's
// matter, not the runbook's.)
func (r *rescueRun) nodeBStagesPR(t *testing.T, ctx context.Context, g *lab.Guest) {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if _, err := g.WaitDiskBySerial(wctx, r.lun.Serial); err != nil {
		t.Fatal(err)
	}
	startAgent(t, ctx, g)
	if st, err := stage(ctx, g, rescuePRVol, r.lun.Serial); err != nil || st.Formatted || st.Fencing != "FENCING_METHOD_SCSI3_PR" {
		t.Fatalf("node-b's stage of the volume on the disk with PR after the rescue: %+v %v", st, err)
	}
	if out := mustSh(t, ctx, g, "cat "+stagingOf(rescuePRVol)+"/pr.txt"); out != rescuePRData {
		t.Fatalf("node-b reads %q on the disk with PR after the rescue", out)
	}
	mustUnstage(t, ctx, g, rescuePRVol)
	stopAgent(t, ctx, g)
	t.Logf("node-b staged %s on the disk with PR after the rescue and read its file", rescuePRVol)
}

// nodeRestages: node-a boots again with the disk; its agent stages the
// volume with the passphrase unwrapped from the token, as the node plugin
// does for a later stage, formats nothing, and both files are there.
func (r *rescueRun) nodeRestages(t *testing.T, ctx context.Context) {
	t.Helper()
	gs, err := r.l.StartGuests(ctx, lab.GuestConfig{Name: "node-a", MemMB: 512, Disks: []lab.Disk{r.disk()}},
		lab.GuestConfig{Name: "node-b", MemMB: 384, Disks: []lab.Disk{r.prDisk()}})
	if err != nil {
		t.Fatal(err)
	}
	g := gs[0]
	r.nodeBStagesPR(t, ctx, gs[1])
	if _, err := g.WaitDiskBySerial(ctx, rescueSerial); err != nil {
		t.Fatal(err)
	}
	startAgent(t, ctx, g)
	loc := []string{"--serial", rescueSerial}
	var tok volumeToken
	if err := agentJSON(ctx, g, &tok, append([]string{"volume", "token", rescueVol}, loc...)...); err != nil ||
		tok.Content != "VOLUME_CONTENT_LUKS2" || tok.TransitToken == nil {
		t.Fatalf("token after the rescue: %+v %v", tok, err)
	}
	pass, err := r.tc.Decrypt(ctx, tok.TransitToken.KeyName, tok.TransitToken.Ciphertext)
	if err != nil {
		t.Fatal(err)
	}
	mustSh(t, ctx, g, fmt.Sprintf("printf %%s '%s' > /run/pw", pass))
	began := time.Now()
	var st stageReply
	if err := agentJSON(ctx, g, &st, append([]string{"volume", "stage", rescueVol, "--staging", stagingOf(rescueVol), "--passphrase-file", "/run/pw"}, loc...)...); err != nil ||
		st.Formatted || st.Fencing != "FENCING_METHOD_DISK_LEASE" {
		t.Fatalf("node-a's stage after the rescue: %+v %v", st, err)
	}
	t.Logf("node-a, rebooted, staged %s again in %s", rescueVol, time.Since(began).Round(100*time.Millisecond))
	s := stagingOf(rescueVol)
	if out := mustSh(t, ctx, g, fmt.Sprintf("cat %s/before.txt; echo; cat %s/last.txt", s, s)); out != rescueBefore+"\n"+rescueLast {
		t.Fatalf("node-a reads %q after the rescue", out)
	}
	if err := agentJSON(ctx, g, nil, "volume", "unstage", rescueVol, "--staging", s); err != nil {
		t.Fatal(err)
	}
	stopAgent(t, ctx, g)
}
