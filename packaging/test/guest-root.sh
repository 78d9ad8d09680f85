#!/bin/bash
# Makes the Debian 12 (bookworm) guest root file system that both the
# packaging check (guest-boot.sh) and the lab's systemd guest
# (integration/lab/debian.go, scenario E9) boot: a minbase debootstrap with
# systemd, udev, dbus, cloud-init and the kernel, kept as a tar in the cache
# (about 14 minutes the first time, then reused). Prints the tar's path on
# stdout; progress goes to stderr. Run as root:
#   packaging/test/guest-root.sh
set -euo pipefail

# Kept outside the work tree so fresh clones on this machine reuse it.
CACHE=${VCO_PKG_CACHE:-/var/cache/vco-packaging}
SUITE=bookworm
base=$CACHE/$SUITE-guest.tar

mirror() {
	local uri
	uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
	[ -n "$uri" ] || uri=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -n1 || true)
	echo "${uri:-http://deb.debian.org/debian}"
}

mkdir -p "$CACHE"
# Two callers at once (make test runs the packaging check and the lab)
# build it once: the second waits for the first.
exec 9>"$CACHE/.$SUITE-guest.lock"
flock 9
if [ ! -s "$base" ]; then
	printf '\n== %s\n' "debootstrap the guest root (systemd, udev, dbus, cloud-init, kernel; cached in $base)" >&2
	work=$(mktemp -d /tmp/vco-guestroot.XXXXXX)
	trap 'rm -rf "$work"' EXIT
	# python3-cffi-backend is named because debootstrap's resolver does
	# not follow the virtual package python3-cryptography depends on.
	debootstrap --variant=minbase \
		--include=systemd,systemd-sysv,udev,dbus,cloud-init,python3-cffi-backend,linux-image-amd64,adduser,kmod \
		"$SUITE" "$work/bootstrap" "$(mirror)" >"$work/debootstrap.log" 2>&1 ||
		{ tail -n 30 "$work/debootstrap.log" >&2; echo "FAIL: debootstrap of $SUITE failed" >&2; exit 1; }
	tar -C "$work/bootstrap" -cf "$base.tmp" .
	mv "$base.tmp" "$base"
fi
echo "$base"
