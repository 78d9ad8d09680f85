#!/bin/bash
# Boots a Debian 12 guest (QEMU, TCG) whose root file system has the
# vco-agent .deb installed and a cloud-init NoCloud seed made from
# packaging/cloud-init/user-data.yaml, and checks on two boots (first boot,
# then after a reboot) that vco-agent is active, its socket has the
# packaged mode and group, and `vco-agent identity` prints the SMBIOS UUID
# QEMU gave the guest. Run from the repository root as root:
#   packaging/test/guest-boot.sh dist/vco-agent_<version>_amd64.deb
set -euo pipefail

DEB=$(realpath "$1")
ROOT=$(pwd)
UUID=5b1c8e3a-9f2d-4c61-8a0e-3d7f6b2a9c14
LOCATION=guest-check-location
WORK=$(mktemp -d /tmp/vco-guestboot.XXXXXX)
QEMU_PID=
cleanup() {
	if [ -n "$QEMU_PID" ] && kill -0 "$QEMU_PID" 2>/dev/null; then
		kill "$QEMU_PID" 2>/dev/null || true
		wait "$QEMU_PID" 2>/dev/null || true
	fi
	rm -rf "$WORK"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }
fail() {
	printf 'FAIL: %s\n' "$*" >&2
	if [ -s "$WORK/serial.log" ]; then
		echo "--- last lines of the guest console:" >&2
		tail -n 60 "$WORK/serial.log" >&2
	fi
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
timeout 900 qemu-system-x86_64 -accel tcg -cpu max -m 1024 -smp 1 \
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
