#!/bin/bash
# Boots a Debian 12 guest (QEMU, TCG) whose root file system has the
# vco-agent .deb installed and a cloud-init NoCloud seed made from
# packaging/cloud-init/user-data.yaml, and checks on two boots (first boot,
# then after a reboot) that vco-agent is active, its socket has the
# packaged mode and group, and `vco-agent identity` prints the SMBIOS UUID
# QEMU gave the guest.
#
# Then two guests from the plain root, without the package, boot with the
# user-data `make repo` renders for a stock image (dist/repo/user-data.yaml),
# its repository made by make-repo.sh from the packages beside the .deb and
# served on the host's loopback, which the guests reach through QEMU's user
# network (restrict=on: nothing else, so apt has no other source):
#   repo:     apt verifies the repository (signed-by, no trusted=yes),
#             cloud-init installs vco-agent through packages:, and the agent
#             runs with the node's location;
#   tampered: the same with an InRelease altered after signing: cloud-init's
#             install fails with apt's message, cloud-init reports an error,
#             and nothing of the agent is installed, enabled or running.
# Run from the repository root as root:
#   packaging/test/guest-boot.sh dist/vco-agent_<version>_amd64.deb
set -euo pipefail

DEB=$(realpath "$1")
ROOT=$(pwd)
UUID=5b1c8e3a-9f2d-4c61-8a0e-3d7f6b2a9c14
LOCATION=guest-check-location
WORK=$(mktemp -d /tmp/vco-guestboot.XXXXXX)
QEMU_PID=
REPO_PIDS=()
cleanup() {
	for pid in $QEMU_PID "${REPO_PIDS[@]}"; do
		if kill -0 "$pid" 2>/dev/null; then
			kill "$pid" 2>/dev/null || true
			wait "$pid" 2>/dev/null || true
		fi
	done
	rm -rf "$WORK"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }
fail() {
	printf 'FAIL: %s\n' "$*" >&2
	for log in "$WORK"/serial*.log; do
		[ -s "$log" ] || continue
		echo "--- last lines of the guest console ($(basename "$log")):" >&2
		tail -n 60 "$log" >&2
	done
	exit 1
}

# The debootstrapped root, shared with the lab's systemd guest.
base=$("$(dirname "$0")/guest-root.sh") || fail "no Debian guest root"

step "guest root: install $(basename "$DEB"), the NoCloud seed and the check"
rootfs=$WORK/rootfs
mkdir "$rootfs"
tar -C "$rootfs" -xf "$base"
cp "$DEB" "$rootfs/tmp/vco-agent.deb"
chroot "$rootfs" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin dpkg -i /tmp/vco-agent.deb >/dev/null
rm "$rootfs/tmp/vco-agent.deb"

echo vco-guest >"$rootfs/etc/hostname"
echo '/dev/vda / ext4 defaults 0 1' >"$rootfs/etc/fstab"
# Only the NoCloud seed on the root file system: nothing probes for a cloud.
printf 'datasource_list: [ NoCloud, None ]\n' >"$rootfs/etc/cloud/cloud.cfg.d/90-vco-guest-check.cfg"
seed=$rootfs/var/lib/cloud/seed/nocloud
mkdir -p "$seed"
# The template sets no location (the node plugin learns it from the
# controller); the check turns its commented override on, to see the file
# written as given.
sed -e 's/^      # node:$/      node:/' -e "s/^      #   location: ch-lug-1\$/        location: \"$LOCATION\"/" \
	packaging/cloud-init/user-data.yaml >"$seed/user-data"
printf 'instance-id: vco-guest-check\nlocal-hostname: vco-guest\n' >"$seed/meta-data"
# The package enabled the units at install; the seed must be what enables
# them here, as on a node image built without running maintainer scripts.
rm -f "$rootfs/etc/systemd/system/multi-user.target.wants/vco-agent.service" \
	"$rootfs/etc/systemd/system/sockets.target.wants/vco-agent.socket"

cat >"$rootfs/usr/local/sbin/vco-guest-check" <<'EOF'
#!/bin/sh
# Reports the agent's state on the serial console, then reboots once and
# powers off after the second boot.
set -u
mkdir -p /var/lib/vco-guest-check
n=$(( $(cat /var/lib/vco-guest-check/boots 2>/dev/null || echo 0) + 1 ))
echo "$n" >/var/lib/vco-guest-check/boots
say() { echo "VCO-GUEST-CHECK boot=$n $*" >/dev/ttyS0; }
cloud-init status --wait >/dev/null 2>&1
i=0
while [ $i -lt 120 ] && ! systemctl is-active --quiet vco-agent.service; do sleep 1; i=$((i + 1)); done
say "agent=$(systemctl is-active vco-agent.service) enabled=$(systemctl is-enabled vco-agent.service)"
say "socket=$(stat -c '%a %G %F' /run/vco-agent/agent.sock 2>&1)"
say "identity=$(vco-agent identity 2>&1 | tr '\n' ' ')"
say "config=$(grep -c 'location: "guest-check-location"' /etc/vco-agent/config.yaml)"
if ! systemctl is-active --quiet vco-agent.service; then
	journalctl -b -u vco-agent.service --no-pager -n 20 2>&1 | while IFS= read -r l; do say "journal: $l"; done
fi
if [ "$n" -eq 2 ]; then
	# metrics.listen, set on the first boot, must be served on loopback
	# under the packaged unit as it is, with no drop-in.
	say "metrics=$(bash -c 'exec 3<>/dev/tcp/127.0.0.1/9465 && printf "GET /metrics HTTP/1.0\r\n\r\n" >&3 && grep -c "^vco_agent_claims{state=.held.} " <&3' 2>&1)"
fi
if [ "$n" -eq 1 ]; then
	printf 'metrics:\n  listen: 127.0.0.1:9465\n' >>/etc/vco-agent/config.yaml
	say "rebooting"
	systemctl reboot
else
	say "done"
	systemctl poweroff
fi
EOF
chmod 0755 "$rootfs/usr/local/sbin/vco-guest-check"
cat >"$rootfs/etc/systemd/system/vco-guest-check.service" <<'EOF'
[Unit]
Description=vco-agent packaging check
After=vco-agent.service

[Service]
# simple, not oneshot: the check waits for cloud-final, which runs after
# multi-user.target, which would otherwise wait for the check.
Type=simple
ExecStart=/usr/local/sbin/vco-guest-check

[Install]
WantedBy=multi-user.target
EOF
ln -s /etc/systemd/system/vco-guest-check.service "$rootfs/etc/systemd/system/multi-user.target.wants/vco-guest-check.service"

kernel=$(ls "$rootfs"/boot/vmlinuz-* | head -n1)
initrd=$(ls "$rootfs"/boot/initrd.img-* | head -n1)
cp "$kernel" "$WORK/vmlinuz"
cp "$initrd" "$WORK/initrd.img"

step "guest image"
mke2fs -q -t ext4 -d "$rootfs" -L vco-guest "$WORK/root.img" 3G
rm -rf "$rootfs"

step "boot (TCG), reboot, power off"
# Two boots; under a loaded host (make test runs other guests beside it)
# one has taken 10 minutes.
timeout 1800 qemu-system-x86_64 -accel tcg -cpu max -m 1024 -smp 1 \
	-nodefaults -no-user-config -display none \
	-serial "file:$WORK/serial.log" \
	-kernel "$WORK/vmlinuz" -initrd "$WORK/initrd.img" \
	-append "root=/dev/vda rw console=ttyS0 net.ifnames=0 systemd.show_status=0" \
	-drive "file=$WORK/root.img,format=raw,if=virtio" \
	-smbios "type=1,uuid=$UUID,manufacturer=whitesky.cloud,product=VCO Guest Check,serial=guest-0001" \
	-nic none &
QEMU_PID=$!
wait "$QEMU_PID" || fail "QEMU failed or timed out (exit $?)"
QEMU_PID=

grep -a 'VCO-GUEST-CHECK' "$WORK/serial.log" || true
for n in 1 2; do
	line() { grep -a "VCO-GUEST-CHECK boot=$n $1" "$WORK/serial.log" | tr -d '\r' | tail -n1; }
	[ -n "$(line agent=active)" ] || fail "boot $n: vco-agent is not active: $(line agent=)"
	[ -n "$(line 'agent=active enabled=enabled')" ] || fail "boot $n: vco-agent is not enabled: $(line agent=)"
	[ -n "$(line 'socket=660 vco-agent socket')" ] || fail "boot $n: socket: $(line socket=)"
	line identity= | grep -qF "$UUID" || fail "boot $n: identity does not show the SMBIOS UUID $UUID: $(line identity=)"
	[ -n "$(line config=1)" ] || fail "boot $n: cloud-init did not write the configuration"
done
[ -n "$(grep -a 'VCO-GUEST-CHECK boot=2 metrics=1' "$WORK/serial.log")" ] ||
	fail "boot 2: under the packaged unit the agent does not serve /metrics on loopback: $(grep -a 'VCO-GUEST-CHECK boot=2 metrics=' "$WORK/serial.log")"
[ -n "$(grep -a 'VCO-GUEST-CHECK boot=2 done' "$WORK/serial.log")" ] || fail "the second boot did not finish"

step "guest boot OK"



# --- cloud-init on a stock image: vco-agent from the signed repository -----------

# gpg for the guests: cloud-init turns the user-data's armored key into a
# keyring with `gpg --dearmor` (cloud images carry gpg; the debootstrapped
# root does not). Downloaded once into the cache.
gpgdebs=${VCO_PKG_CACHE:-/var/cache/vco-packaging}/bookworm-gpg
if [ ! -e "$gpgdebs/.done" ]; then
	step "download gpg for the guests (cached in $gpgdebs)"
	mkdir -p "$gpgdebs"
	(cd "$gpgdebs" && apt-get download gpg gpgconf libassuan0 libnpth0) >"$WORK/apt-download.log" 2>&1 ||
		{ cat "$WORK/apt-download.log" >&2; fail "apt-get download gpg gpgconf libassuan0 libnpth0 failed"; }
	touch "$gpgdebs/.done"
fi

step "repository: make-repo.sh on the packages beside $(basename "$DEB")"
# The guests reach the host's loopback only through this forward.
REPO_HOST=10.0.2.100
mkdir -p "$WORK/dist" "$WORK/serve"
cp "$(dirname "$DEB")"/vco-agent_*.deb "$(dirname "$DEB")"/vco-agent-*.rpm "$WORK/dist/"
VCO_REPO_URL=http://$REPO_HOST/good packaging/repo/make-repo.sh "$WORK/dist" >"$WORK/make-repo.log" 2>&1 ||
	{ cat "$WORK/make-repo.log" >&2; fail "make-repo.sh failed"; }
mv "$WORK/dist/repo" "$WORK/serve/good"
# The same repository with its InRelease altered after signing, and its
# user-data pointing at it.
cp -a "$WORK/serve/good" "$WORK/serve/tampered"
sed -i 's|/good/|/tampered/|g' "$WORK/serve/tampered/user-data.yaml"
sed -i 's/^Label: vco-storage$/Label: vco-storage-altered/' "$WORK/serve/tampered/apt/dists/stable/InRelease"
cmp -s "$WORK/serve/good/apt/dists/stable/InRelease" "$WORK/serve/tampered/apt/dists/stable/InRelease" &&
	fail "the check did not alter InRelease"

# The repository on the host's loopback, at a port of the kernel's choosing.
python3 -u -c '
import functools, http.server, sys
class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=sys.argv[1]))
with open(sys.argv[2] + ".tmp", "w") as f: f.write(str(s.server_port))
import os; os.rename(sys.argv[2] + ".tmp", sys.argv[2])
s.serve_forever()' "$WORK/serve" "$WORK/http.port" &
REPO_PIDS+=($!)
i=0
until [ -s "$WORK/http.port" ]; do
	i=$((i + 1))
	[ $i -lt 600 ] || fail "the repository's HTTP server did not start"
	sleep 0.1
done
port=$(cat "$WORK/http.port")

cat >"$WORK/vco-repo-check" <<'EOF'
#!/bin/sh
# Reports what cloud-init did with the repository's user-data on the serial
# console, then powers off.
set -u
say() { echo "VCO-REPO-CHECK $*" >/dev/ttyS0; }
# cloud-init status --wait returns at the first stage's error, while the
# final stage (packages:, runcmd) may still run: wait for the boot's jobs,
# cloud-final's among them, to end.
systemctl is-system-running --wait >/dev/null 2>&1
cloud-init status --wait >/dev/null 2>&1
say "status=$(cloud-init status 2>&1 | tr '\n' ' ')"
say "installed=$(dpkg-query -W -f='${Status} ${Version}' vco-agent 2>/dev/null)"
say "sources=$(cat /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v '^#' | grep . | tr '\n' ';')"
say "trusted=$(cat /etc/apt/sources.list.d/* /etc/apt/sources.list 2>/dev/null | grep -c 'trusted=yes')"
if command -v vco-agent >/dev/null; then
	i=0
	while [ $i -lt 120 ] && ! systemctl is-active --quiet vco-agent.service; do sleep 1; i=$((i + 1)); done
fi
say "agent=$(systemctl is-active vco-agent.service vco-agent.socket | tr '\n' ' ')"
say "units=$(systemctl list-unit-files --no-legend 'vco-agent*' | wc -l) enabled=$(systemctl is-enabled vco-agent.service 2>/dev/null)"
say "socket=$(test -S /run/vco-agent/agent.sock && echo present || echo absent)"
say "identity=$(vco-agent identity 2>&1 | tr '\n' ' ')"
say "config=$(grep -c 'location: "guest-check-location"' /etc/vco-agent/config.yaml 2>/dev/null)"
grep -a -e '^E: ' -e '^W: GPG error' -e 'BADSIG' -e 'vco-agent is not installed' /var/log/cloud-init-output.log 2>/dev/null |
	head -n 10 | while IFS= read -r l; do say "output: $l"; done
if [ "$(dpkg-query -W -f='${Status}' vco-agent 2>/dev/null)" != "install ok installed" ]; then
	tail -n 30 /var/log/cloud-init-output.log | while IFS= read -r l; do say "log: $l"; done
	grep -a -e WARNING -e ERROR /var/log/cloud-init.log | tail -n 20 | while IFS= read -r l; do say "log: $l"; done
fi
say "done"
systemctl poweroff
EOF

# repo_guest NAME: an image from the plain root (no vco-agent) with the
# user-data of the repository served as NAME as its NoCloud seed, the
# location override turned on as above, and networking to the host.
repo_guest() {
	local name=$1 r=$WORK/rootfs-$1
	mkdir "$r"
	tar -C "$r" -xf "$base"
	cp "$gpgdebs"/*.deb "$r/tmp/"
	chroot "$r" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin sh -c 'dpkg -i /tmp/*.deb >/dev/null && rm /tmp/*.deb'
	echo vco-guest >"$r/etc/hostname"
	echo '/dev/vda / ext4 defaults 0 1' >"$r/etc/fstab"
	# The lab repository is the guest's only source.
	: >"$r/etc/apt/sources.list"
	printf 'datasource_list: [ NoCloud, None ]\nnetwork: {config: disabled}\nlocale: C.UTF-8\n' >"$r/etc/cloud/cloud.cfg.d/90-vco-guest-check.cfg"
	printf '[Match]\nMACAddress=52:54:00:12:34:56\n\n[Network]\nAddress=10.0.2.15/24\n' >"$r/etc/systemd/network/10-vco-lab.network"
	ln -s /lib/systemd/system/systemd-networkd.service "$r/etc/systemd/system/multi-user.target.wants/systemd-networkd.service"
	mkdir -p "$r/etc/systemd/system/network-online.target.wants"
	ln -s /lib/systemd/system/systemd-networkd-wait-online.service \
		"$r/etc/systemd/system/network-online.target.wants/systemd-networkd-wait-online.service"
	local seed=$r/var/lib/cloud/seed/nocloud
	mkdir -p "$seed"
	# preserve_sources_list: cloud-init would otherwise write Debian's
	# mirrors into the emptied sources.list.
	sed -e 's/^      # node:$/      node:/' -e "s/^      #   location: ch-lug-1\$/        location: \"$LOCATION\"/" \
		-e 's/^apt:$/apt:\n  preserve_sources_list: true/' \
		"$WORK/serve/$name/user-data.yaml" >"$seed/user-data"
	grep -q "location: \"$LOCATION\"" "$seed/user-data" || fail "$name: the location override is not in the user-data"
	printf 'instance-id: vco-repo-%s\nlocal-hostname: vco-guest\n' "$name" >"$seed/meta-data"
	install -m 0755 "$WORK/vco-repo-check" "$r/usr/local/sbin/vco-repo-check"
	printf '[Unit]\nDescription=vco-agent repository check\n\n[Service]\nType=simple\nExecStart=/usr/local/sbin/vco-repo-check\n\n[Install]\nWantedBy=multi-user.target\n' \
		>"$r/etc/systemd/system/vco-repo-check.service"
	ln -s /etc/systemd/system/vco-repo-check.service "$r/etc/systemd/system/multi-user.target.wants/vco-repo-check.service"
	mke2fs -q -t ext4 -d "$r" -L vco-guest "$WORK/root-$name.img" 3G
	rm -rf "$r"
}

step "guest images from the plain root with the repository's user-data, and the tampered one's"
for name in good tampered; do repo_guest "$name"; done

step "boot both (TCG, side by side): cloud-init installs vco-agent from the repository"
t0=$(date +%s)
pids=()
for name in good tampered; do
	timeout 1200 qemu-system-x86_64 -accel tcg -cpu max -m 1024 -smp 1 \
		-nodefaults -no-user-config -display none \
		-serial "file:$WORK/serial-$name.log" \
		-kernel "$WORK/vmlinuz" -initrd "$WORK/initrd.img" \
		-append "root=/dev/vda rw console=ttyS0 net.ifnames=0 systemd.show_status=0" \
		-drive "file=$WORK/root-$name.img,format=raw,if=virtio" \
		-smbios "type=1,uuid=$UUID,manufacturer=whitesky.cloud,product=VCO Guest Check,serial=guest-0001" \
		-netdev "user,id=net0,restrict=on,net=10.0.2.0/24,guestfwd=tcp:$REPO_HOST:80-cmd:busybox nc 127.0.0.1 $port" \
		-device virtio-net-pci,netdev=net0,mac=52:54:00:12:34:56 &
	pids+=($!)
	REPO_PIDS+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || fail "QEMU failed or timed out (exit $?)"; done
echo "both guests powered off after $(($(date +%s) - t0)) s"

grep -a -h 'VCO-REPO-CHECK' "$WORK/serial-good.log" "$WORK/serial-tampered.log" | tr -d '\r' || true
rline() { tr -d '\r' <"$WORK/serial-$1.log" | grep -a "VCO-REPO-CHECK $2" | tail -n1; }
for name in good tampered; do
	[ -n "$(rline $name done)" ] || fail "$name: the check did not finish"
	src=$(rline $name sources=)
	echo "$src" | grep -qF "deb [signed-by=/etc/apt/cloud-init.gpg.d/vco-storage.gpg] http://$REPO_HOST/$name/apt stable main" ||
		fail "$name: apt's source is not the repository signed by its key: $src"
	[ "$(echo "${src#*sources=}" | tr ';' '\n' | grep -c .)" = 1 ] || fail "$name: apt has other sources: $src"
	[ -n "$(rline $name trusted=0)" ] || fail "$name: a source says trusted=yes"
done
# The repository: verified, vco-agent installed by cloud-init, running
# with the node's location.
[ -n "$(rline good 'installed=install ok installed')" ] || fail "good: vco-agent is not installed: $(rline good installed=)"
[ -n "$(rline good 'agent=active active')" ] || fail "good: vco-agent is not active: $(rline good agent=)"
[ -n "$(rline good 'units=2 enabled=enabled')" ] || fail "good: vco-agent is not enabled: $(rline good units=)"
rline good identity= | grep -qF "$UUID" || fail "good: identity does not show the SMBIOS UUID $UUID: $(rline good identity=)"
rline good identity= | grep -qF "$LOCATION" || fail "good: identity does not show the location $LOCATION: $(rline good identity=)"
[ -n "$(rline good config=1)" ] || fail "good: /etc/vco-agent/config.yaml does not hold the location"
rline good status= | grep -q 'status: done' || fail "good: cloud-init did not finish cleanly: $(rline good status=)"
[ -z "$(rline good 'output: ')" ] || fail "good: apt or the seed complained: $(rline good 'output: ')"
# The tampered one: apt's message, cloud-init's error, nothing of the agent.
grep -a 'VCO-REPO-CHECK output: ' "$WORK/serial-tampered.log" | grep -q -e 'BADSIG' -e 'is not signed' ||
	fail "tampered: cloud-init's output does not carry apt's signature error"
grep -a 'VCO-REPO-CHECK output: ' "$WORK/serial-tampered.log" | grep -q 'vco-agent is not installed' ||
	fail "tampered: the seed's runcmd did not say that vco-agent is not installed"
rline tampered status= | grep -q 'status: error' || fail "tampered: cloud-init does not report an error: $(rline tampered status=)"
[ -n "$(rline tampered 'installed=$')" ] || fail "tampered: vco-agent is installed: $(rline tampered installed=)"
[ -n "$(rline tampered 'units=0 ')" ] || fail "tampered: vco-agent's units exist: $(rline tampered units=)"
[ -n "$(rline tampered 'agent=inactive inactive')" ] || fail "tampered: something of vco-agent runs: $(rline tampered agent=)"
[ -n "$(rline tampered 'socket=absent')" ] || fail "tampered: the agent's socket exists"

step "cloud-init from the repository OK"
