#!/bin/bash
# Checks the vco-agent packages in DIST (default dist/) the way their
# ecosystems would: lintian and rpmlint, systemd-analyze verify and
# security, cloud-init's schema, then install, upgrade (a changed conffile
# survives), remove and purge in a Debian chroot, and install and erase
# with rpm --root. Run from the repository root as root; `make
# test-packages` does.
set -euo pipefail

DIST=$(realpath "${1:-dist}")
ROOT=$(pwd)
# Kept outside the work tree so fresh clones on this machine reuse it.
CACHE=${VCO_PKG_CACHE:-/var/cache/vco-packaging}
SUITE=bookworm
WORK=$(mktemp -d /tmp/vco-pkgcheck.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

shopt -s nullglob
debs=("$DIST"/vco-agent_*.deb)
rpms=("$DIST"/vco-agent-*.rpm)
shopt -u nullglob
[ ${#debs[@]} -eq 2 ] || fail "want the amd64 and arm64 .deb in $DIST, found: ${debs[*]:-none}"
[ ${#rpms[@]} -eq 2 ] || fail "want the x86_64 and aarch64 .rpm in $DIST, found: ${rpms[*]:-none}"
deb_amd64=$(printf '%s\n' "${debs[@]}" | grep '_amd64\.deb$') || fail "no amd64 .deb in $DIST"
rpm_x86_64=$(printf '%s\n' "${rpms[@]}" | grep '\.x86_64\.rpm$') || fail "no x86_64 .rpm in $DIST"

step "lintian: no errors or warnings beyond the package's overrides"
lintian --fail-on error,warning --info "${debs[@]}"

step "rpm payload: relative member names (./usr/...), as rpmbuild writes them"
# rpmlint below unpacks each payload with a plain `cpio -id`: an absolute
# name would land in this machine's /.
for r in "${rpms[@]}"; do
	bad=$(rpm2cpio "$r" | cpio -t --quiet | grep -v '^\./' || true)
	[ -z "$bad" ] || fail "$(basename "$r"): payload members not under ./: $(echo $bad)"
done

step "rpmlint: no errors (filters in packaging/rpm/rpmlint.toml)"
(cd "$WORK" && rpmlint -c "$ROOT/packaging/rpm/rpmlint.toml" "${rpms[@]}")

step "systemd-analyze verify: both units, as installed by the package"
unitroot=$WORK/unitroot
mkdir "$unitroot"
dpkg-deb -x "$deb_amd64" "$unitroot"
# The units' dependencies (sysinit.target, ...) come from this machine's
# systemd; the package's own files win.
cp -an /usr/lib/systemd/system/. "$unitroot/usr/lib/systemd/system/"
MANPATH=$unitroot/usr/share/man systemd-analyze verify --root="$unitroot" \
	/usr/lib/systemd/system/vco-agent.socket /usr/lib/systemd/system/vco-agent.service

step "systemd-analyze security: exposure matches the README"
exposure=$(systemd-analyze security --offline=true --root="$unitroot" /usr/lib/systemd/system/vco-agent.service |
	sed -n 's/.*Overall exposure level for vco-agent.service: \([0-9.]*\) \([A-Z]*\).*/\1 \2/p')
[ -n "$exposure" ] || fail "systemd-analyze security printed no exposure level"
echo "exposure: $exposure"
grep -qF "exposure level: $exposure" packaging/README.md ||
	fail "packaging/README.md does not record the current exposure level ($exposure): update it"

step "systemd-analyze security: every remaining exposure is explained in the unit"
counted=$(systemd-analyze security --offline=true --root="$unitroot" /usr/lib/systemd/system/vco-agent.service |
	awk '$1 == "\342\234\227" {print $2}')
[ -n "$counted" ] || fail "systemd-analyze security listed no counted exposures: the check cannot read its table"
unexplained=$(while read -r name; do
	grep -qF "# exposure: $name -- " packaging/systemd/vco-agent.service || echo "$name"
done <<<"$counted")
[ -z "$unexplained" ] || fail "vco-agent.service has no '# exposure: NAME -- why' line for: $(echo $unexplained)"
echo "$(echo "$counted" | wc -l) counted exposures, each explained in the unit"

step "cloud-init schema"
cloud-init schema --config-file packaging/cloud-init/user-data.yaml

# --- Debian chroot -----------------------------------------------------------

mirror() {
	local uri
	uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
	[ -n "$uri" ] || uri=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -n1 || true)
	echo "${uri:-http://deb.debian.org/debian}"
}

base=$CACHE/$SUITE-minbase.tar
if [ ! -s "$base" ]; then
	step "debootstrap $SUITE (cached in $base)"
	mkdir -p "$CACHE"
	debootstrap --variant=minbase --include=adduser "$SUITE" "$WORK/bootstrap" "$(mirror)" >"$WORK/debootstrap.log" 2>&1 ||
		{ tail -n 30 "$WORK/debootstrap.log"; fail "debootstrap failed"; }
	tar -C "$WORK/bootstrap" -cf "$base.tmp" .
	mv "$base.tmp" "$base"
	rm -rf "$WORK/bootstrap"
fi

# Two versions built from the same binary; the second ships a changed
# default config.yaml, so the upgrade must keep the administrator's copy.
step "build upgrade pair v0.0.1 / v0.0.2"
cp packaging/config.yaml "$WORK/config-v2.yaml"
printf '\n# Changed in the upgrade test package.\n' >>"$WORK/config-v2.yaml"
pkg() {
	go run ./packaging/cmd/vco-pkg -arch amd64 -bin-dir bin/linux_%s -help-from bin/vco-agent \
		-maintainer 'vco-storage test <test@localhost>' -work "$WORK/gen-$1" -out "$WORK/$1" -version "$@"
}
pkg v0.0.1 >/dev/null
pkg v0.0.2 -config "$WORK/config-v2.yaml" >/dev/null
deb1=$(echo "$WORK"/v0.0.1/*.deb)
deb2=$(echo "$WORK"/v0.0.2/*.deb)

chroot_dir=$WORK/chroot
mkdir "$chroot_dir"
tar -C "$chroot_dir" -xf "$base"
cp "$deb1" "$chroot_dir/tmp/v1.deb"
cp "$deb2" "$chroot_dir/tmp/v2.deb"
in_chroot() { chroot "$chroot_dir" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 "$@"; }
has() { [ -e "$chroot_dir$1" ] || [ -L "$chroot_dir$1" ]; }
status() { in_chroot dpkg-query -W -f='${Status} ${Version}' vco-agent 2>/dev/null || true; }

step "chroot: install"
in_chroot dpkg -i /tmp/v1.deb
[ "$(status)" = "install ok installed 0.0.1-1" ] || fail "after install: status $(status)"
for f in /usr/bin/vco-agent /usr/lib/systemd/system/vco-agent.service /usr/lib/systemd/system/vco-agent.socket \
	/usr/lib/tmpfiles.d/vco-agent.conf /usr/lib/sysusers.d/vco-agent.conf /usr/lib/udev/rules.d/60-vco-agent.rules \
	/usr/lib/modules-load.d/vco-agent.conf \
	/usr/share/dbus-1/system.d/cloud.whitesky.VcoAgent1.conf /etc/vco-agent/config.yaml \
	/usr/share/man/man8/vco-agent.8.gz /usr/share/doc/vco-agent/copyright \
	/etc/systemd/system/multi-user.target.wants/vco-agent.service \
	/etc/systemd/system/sockets.target.wants/vco-agent.socket; do
	has "$f" || fail "after install: $f missing"
done
in_chroot getent group vco-agent >/dev/null || fail "after install: group vco-agent missing"
[ "$(in_chroot getent group vco-agent | cut -d: -f3)" = 573 ] ||
	fail "after install: group vco-agent does not have gid 573, the gid the add-on's node plugin is given (docs/csi-addon.md)"
in_chroot dpkg-query -W -f='${Conffiles}\n' vco-agent | grep -q '/etc/vco-agent/config.yaml' ||
	fail "after install: /etc/vco-agent/config.yaml is not a conffile"
in_chroot vco-agent version >/dev/null || fail "after install: vco-agent does not run"

step "chroot: upgrade keeps a changed conffile"
echo '# changed by the administrator' >>"$chroot_dir/etc/vco-agent/config.yaml"
in_chroot dpkg -i --force-confdef --force-confold /tmp/v2.deb
[ "$(status)" = "install ok installed 0.0.2-1" ] || fail "after upgrade: status $(status)"
grep -q '^# changed by the administrator$' "$chroot_dir/etc/vco-agent/config.yaml" ||
	fail "after upgrade: the administrator's change to config.yaml is gone"
grep -q '^# Changed in the upgrade test package\.$' "$chroot_dir/etc/vco-agent/config.yaml.dpkg-dist" ||
	fail "after upgrade: the new default is not beside it as config.yaml.dpkg-dist"
has /etc/systemd/system/multi-user.target.wants/vco-agent.service || fail "after upgrade: the service is no longer enabled"

step "chroot: removal and purge refused while a volume is staged"
claim=/var/lib/vco-agent/volumes/dm9sLTE.json
mkdir -p "$chroot_dir/var/lib/vco-agent/volumes"
echo '{"volume":"vol-1","phase":"staged","state":"held"}' >"$chroot_dir$claim"
in_chroot dpkg -r vco-agent && fail "dpkg -r removed the package with a volume staged"
in_chroot dpkg -P vco-agent && fail "dpkg -P purged the package with a volume staged"
# dpkg records the purge as wanted; the package must still be installed.
[ "$(in_chroot dpkg-query -W -f='${db:Status-Status} ${Version}' vco-agent)" = "installed 0.0.2-1" ] ||
	fail "after a refused removal: status $(status)"
has "$claim" || fail "after a refused removal: the claim record is gone"
echo vco-agent install | in_chroot dpkg --set-selections
rm "$chroot_dir$claim"

step "chroot: remove keeps the configuration"
in_chroot dpkg -r vco-agent
[ "$(status)" = "deinstall ok config-files 0.0.2-1" ] || fail "after remove: status $(status)"
has /usr/bin/vco-agent && fail "after remove: /usr/bin/vco-agent still present"
has /etc/vco-agent/config.yaml || fail "after remove: the conffile is gone (only purge removes it)"
# Debian's convention: removal masks the units (their files are gone, the
# enablement stays for a reinstall); purge forgets both.
for u in vco-agent.service vco-agent.socket; do
	[ "$(readlink "$chroot_dir/etc/systemd/system/$u")" = /dev/null ] || fail "after remove: $u is not masked"
done

step "chroot: purge leaves nothing behind"
mkdir -p "$chroot_dir/var/lib/vco-agent/volumes" "$chroot_dir/run/vco-agent"
in_chroot dpkg -P vco-agent
[ -z "$(status)" ] || fail "after purge: dpkg still knows the package: $(status)"
left=$(cd "$chroot_dir" && find . -xdev \( -name '*vco-agent*' -o -name '*VcoAgent*' \) -print)
[ -z "$left" ] || fail "after purge, left behind: $left"

# --- rpm --root --------------------------------------------------------------

step "rpm --root: install and erase"
rpmroot=$WORK/rpmroot
mkdir "$rpmroot"
# A Debian userland gives the scriptlets a shell, getent and groupadd; the
# rpm database in it knows none of those packages, hence --nodeps.
tar -C "$rpmroot" -xf "$base"
rpm --root "$rpmroot" --initdb
rpm --root "$rpmroot" -i --nodeps "$rpm_x86_64"
rpm --root "$rpmroot" -q vco-agent >/dev/null || fail "rpm: vco-agent not installed"
rpm --root "$rpmroot" -V --nodeps vco-agent || fail "rpm: installed files do not verify"
for f in /usr/bin/vco-agent /usr/lib/systemd/system/vco-agent.service /etc/vco-agent/config.yaml \
	/usr/share/licenses/vco-agent/copyright /usr/lib/systemd/system-preset/50-vco-agent.preset; do
	[ -e "$rpmroot$f" ] || fail "rpm: $f missing after install"
done
rpm --root "$rpmroot" -qc vco-agent | grep -qx /etc/vco-agent/config.yaml || fail "rpm: config.yaml is not %config"
chroot "$rpmroot" getent group vco-agent >/dev/null || fail "rpm: group vco-agent missing after install"
[ "$(chroot "$rpmroot" getent group vco-agent | cut -d: -f3)" = 573 ] ||
	fail "rpm: group vco-agent does not have gid 573 after install, the gid the add-on's node plugin is given (docs/csi-addon.md)"
mkdir -p "$rpmroot/var/lib/vco-agent/volumes"
echo '{"volume":"vol-1","phase":"staged","state":"held"}' >"$rpmroot$claim"
rpm --root "$rpmroot" -e --nodeps vco-agent && fail "rpm: erased with a volume staged"
rpm --root "$rpmroot" -q vco-agent >/dev/null || fail "rpm: a refused erase removed the package"
VCO_AGENT_FORCE_REMOVE=1 rpm --root "$rpmroot" -e --nodeps vco-agent
[ -e "$rpmroot$claim" ] || fail "rpm: a forced erase deleted the claim record of a staged volume"
rpm --root "$rpmroot" -q vco-agent >/dev/null && fail "rpm: a forced erase left the package installed"
rm -rf "$rpmroot/var/lib/vco-agent"
left=$(cd "$rpmroot" && find . -xdev \( -name '*vco-agent*' -o -name '*VcoAgent*' \) -not -path './var/lib/rpm*' -print)
[ -z "$left" ] || fail "rpm: after erase, left behind: $left"

step "packages OK"
