#!/bin/bash
# Checks `make repo` the way nodes use its output: builds the repositories
# from the packages in DIST (default dist/) into a scratch directory, once
# with a throwaway key and once with a REPO_SIGNING_KEY, serves them on
# 127.0.0.1 with python3's http.server, and then
#   - apt, in an APT root of its own that trusts nothing but the
#     repository's vco-storage.sources (its Signed-By key; no trusted=yes),
#     updates, downloads vco-agent for amd64 and arm64 and gets the bytes of
#     DIST's packages; a tampered InRelease, a tampered Packages, a tampered
#     .deb and a source with another key are each refused with apt's message;
#   - dnf installs vco-agent into an empty --installroot from the
#     repository's vco-storage.repo (gpgcheck=1, repo_gpgcheck=1, gpgkey of
#     the repository); a tampered .rpm (one byte, metadata regenerated and
#     re-signed, so only the package's own signature can catch it) and a
#     tampered repomd.xml are each refused;
#   - the nodes' files (sources, repo file, cloud-init user-data,
#     image-builder variables) name this repository, its key and its
#     package (go test ./packaging/repo with VCO_REPO_DIR set).
# Run from the repository root as root; `make test-repo` does.
set -euo pipefail

DIST=$(realpath "${1:-dist}")
ROOT=$(pwd)
WORK=$(mktemp -d /tmp/vco-repocheck.XXXXXX)
HTTP_PID=
cleanup() {
	if [ -n "$HTTP_PID" ]; then kill "$HTTP_PID" 2>/dev/null || true; fi
	for h in "$WORK"/dist/.repo-throwaway-gnupg "$WORK"/keyhome "$WORK"/gnupg; do
		[ -d "$h" ] && gpgconf --homedir "$h" --kill gpg-agent 2>/dev/null || true
	done
	rm -rf "$WORK"
}
trap cleanup EXIT
# gpg's own state for the check's reads (--show-keys), never ~/.gnupg.
export GNUPGHOME=$WORK/gnupg
mkdir -m 0700 "$GNUPGHOME"

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

shopt -s nullglob
debs=("$DIST"/vco-agent_*.deb)
rpms=("$DIST"/vco-agent-*.rpm)
shopt -u nullglob
[ ${#debs[@]} -eq 2 ] && [ ${#rpms[@]} -eq 2 ] || fail "want the amd64 and arm64 .deb and .rpm in $DIST: run make packages"
deb_amd64=$(printf '%s\n' "${debs[@]}" | grep '_amd64\.deb$')
deb_arm64=$(printf '%s\n' "${debs[@]}" | grep '_arm64\.deb$')
rpm_x86_64=$(printf '%s\n' "${rpms[@]}" | grep '\.x86_64\.rpm$')
version=$(dpkg-deb -f "$deb_amd64" Version)

PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT

step "make-repo with a throwaway key, for $URL"
mkdir "$WORK/dist"
cp "${debs[@]}" "${rpms[@]}" "$WORK/dist/"
VCO_REPO_URL=$URL packaging/repo/make-repo.sh "$WORK/dist" >"$WORK/make-repo.log" 2>&1 ||
	{ cat "$WORK/make-repo.log"; fail "make-repo.sh failed"; }
cat "$WORK/make-repo.log"
grep -q 'WARNING: .* is signed with a THROWAWAY key' "$WORK/make-repo.log" || fail "no warning for the throwaway key"
REPO=$WORK/dist/repo
fpr=$(gpg --batch --with-colons --show-keys "$REPO/vco-storage-archive-keyring.gpg" | awk -F: '$1 == "fpr" {print $10; exit}')
grep -qF "key fingerprint $(echo "$fpr" | sed -E 's/(.{4})/\1 /g; s/ $//')" "$WORK/make-repo.log" ||
	fail "make-repo.sh did not print the shipped key's fingerprint $fpr"
[ "$(gpg --batch --with-colons --show-keys "$REPO/vco-storage-archive-keyring.asc" | awk -F: '$1 == "fpr" {print $10; exit}')" = "$fpr" ] ||
	fail "the armored and binary keyrings hold different keys"

step "make-repo with REPO_SIGNING_KEY (an armored secret key file)"
mkdir -m 0700 "$WORK/keyhome"
gpg --homedir "$WORK/keyhome" --batch --quiet --pinentry-mode loopback --passphrase '' \
	--quick-generate-key 'vco-storage check key <check@localhost>' rsa3072 sign never
release_fpr=$(gpg --homedir "$WORK/keyhome" --batch --with-colons --list-secret-keys | awk -F: '$1 == "fpr" {print $10; exit}')
gpg --homedir "$WORK/keyhome" --batch --armor --export-secret-keys "$release_fpr" >"$WORK/release.key"
mkdir "$WORK/dist2"
cp "${debs[@]}" "${rpms[@]}" "$WORK/dist2/"
REPO_SIGNING_KEY=$WORK/release.key VCO_REPO_URL=$URL packaging/repo/make-repo.sh "$WORK/dist2" >"$WORK/make-repo2.log" 2>&1 ||
	{ cat "$WORK/make-repo2.log"; fail "make-repo.sh with REPO_SIGNING_KEY failed"; }
grep -q THROWAWAY "$WORK/make-repo2.log" && fail "make-repo.sh warned of a throwaway key although REPO_SIGNING_KEY was given"
[ ! -e "$WORK/dist2/.repo-throwaway-gnupg" ] || fail "make-repo.sh made a throwaway key although REPO_SIGNING_KEY was given"
got=$(gpg --batch --with-colons --show-keys "$WORK/dist2/repo/vco-storage-archive-keyring.gpg" | awk -F: '$1 == "fpr" {print $10; exit}')
[ "$got" = "$release_fpr" ] || fail "the repository built with REPO_SIGNING_KEY ships key $got, not $release_fpr"
gpgv --keyring "$WORK/dist2/repo/vco-storage-archive-keyring.gpg" "$WORK/dist2/repo/apt/dists/stable/InRelease" 2>/dev/null ||
	fail "InRelease is not signed by REPO_SIGNING_KEY"

python3 -m http.server --bind 127.0.0.1 --directory "$REPO" "$PORT" >"$WORK/http.log" 2>&1 &
HTTP_PID=$!
for _ in $(seq 50); do
	curl -fsS -o /dev/null "$URL/vco-storage.sources" 2>/dev/null && break
	sleep 0.1
done
curl -fsS -o /dev/null "$URL/vco-storage.sources" || fail "the http server on $URL does not answer"

# --- apt ------------------------------------------------------------------------

# aptroot DIR SOURCES: an APT root that knows only SOURCES; its keyrings
# (trusted.gpg, trusted.gpg.d) are its own, empty.
aptroot() {
	local r=$1
	rm -rf "$r"
	mkdir -p "$r/etc/apt/sources.list.d" "$r/etc/apt/trusted.gpg.d" "$r/etc/apt/preferences.d" "$r/etc/apt/apt.conf.d" \
		"$r/var/lib/apt/lists/partial" "$r/var/cache/apt/archives/partial" "$r/var/lib/dpkg"
	: >"$r/var/lib/dpkg/status"
	cp "$2" "$r/etc/apt/sources.list.d/vco-storage.sources"
}
# apt_in DIR ARGS...: apt-get confined to the root DIR, amd64 with arm64;
# APT_CMD=apt-cache for apt-cache.
apt_in() {
	local r=$1
	shift
	"${APT_CMD:-apt-get}" -q -o Dir="$r" -o Dir::State::status="$r/var/lib/dpkg/status" \
		-o APT::Architecture=amd64 -o APT::Architectures::=amd64 -o APT::Architectures::=arm64 \
		-o Debug::NoLocking=1 -o Acquire::Languages=none -o APT::Sandbox::User=root "$@"
}

step "apt: the sources file trusts nothing but the shipped key"
grep -qi 'trusted' "$REPO/vco-storage.sources" && fail "vco-storage.sources says trusted"
a=$WORK/apt
aptroot "$a" "$REPO/vco-storage.sources"
apt_in "$a" update >"$WORK/apt.log" 2>&1 || { cat "$WORK/apt.log"; fail "apt-get update from $URL failed"; }
cat "$WORK/apt.log"
grep -qE '^(W|E):' "$WORK/apt.log" && fail "apt-get update warned"
[ "$(APT_CMD=apt-cache apt_in "$a" policy vco-agent | awk '/Candidate:/ {print $2}')" = "$version" ] || fail "apt sees no vco-agent $version"

step "apt: download vco-agent for amd64 and arm64"
(cd "$WORK" && apt_in "$a" download vco-agent vco-agent:arm64) || fail "apt-get download failed"
cmp "$WORK/$(basename "$deb_amd64")" "$deb_amd64" || fail "apt downloaded other bytes than $deb_amd64"
cmp "$WORK/$(basename "$deb_arm64")" "$deb_arm64" || fail "apt downloaded other bytes than $deb_arm64"

# refused WHAT PATTERN: the apt-get update or download in $WORK/apt.log
# failed with apt's message matching PATTERN.
refused() {
	local rc=$1 what=$2 pattern=$3
	[ "$rc" -ne 0 ] || { cat "$WORK/apt.log"; fail "apt accepted $what"; }
	grep -E "$pattern" "$WORK/apt.log" >&2 || { cat "$WORK/apt.log"; fail "apt refused $what, but not with '$pattern'"; }
}
inrelease=$REPO/apt/dists/stable/InRelease
cp -a "$REPO/apt/dists" "$WORK/dists.good"
restore() { rm -rf "$REPO/apt/dists" && cp -a "$WORK/dists.good" "$REPO/apt/dists"; }

step "apt: a tampered InRelease is refused"
# One byte of the signed text changed (the Label field).
sed -i 's/^Label: vco-storage$/Label: vco-storagf/' "$inrelease"
cmp -s "$inrelease" "$WORK/dists.good/stable/InRelease" && fail "the check did not change InRelease"
aptroot "$a" "$REPO/vco-storage.sources"
rc=0; apt_in "$a" update >"$WORK/apt.log" 2>&1 || rc=$?
refused "$rc" "a tampered InRelease" 'BADSIG|signatures were invalid'
restore

step "apt: a tampered Packages is refused"
for arch in amd64; do
	p=$REPO/apt/dists/stable/main/binary-$arch/Packages
	sed -i 's/^Priority: optional$/Priority: required/' "$p"
	cmp -s "$p" "$WORK/dists.good/stable/main/binary-$arch/Packages" && fail "the check did not change Packages"
	gzip -9nc "$p" >"$p.gz"
done
aptroot "$a" "$REPO/vco-storage.sources"
rc=0; apt_in "$a" update >"$WORK/apt.log" 2>&1 || rc=$?
refused "$rc" "a tampered Packages" 'Hash Sum mismatch|unexpected size'
restore

step "apt: a tampered .deb is refused"
aptroot "$a" "$REPO/vco-storage.sources"
apt_in "$a" update >/dev/null 2>&1 || fail "apt-get update failed on the restored repository"
pooldeb=$REPO/apt/pool/main/v/vco-agent/$(basename "$deb_amd64")
cp "$pooldeb" "$WORK/deb.good"
printf '\xff' | dd of="$pooldeb" bs=1 seek=$(($(stat -c %s "$pooldeb") - 100)) conv=notrunc status=none
rc=0; (cd "$WORK" && rm -f vco-agent_*.deb && apt_in "$a" download vco-agent) >"$WORK/apt.log" 2>&1 || rc=$?
refused "$rc" "a tampered .deb" 'Hash Sum mismatch|unexpected size'
cp "$WORK/deb.good" "$pooldeb"

step "apt: a source that names another key is refused"
aptroot "$a" "$WORK/dist2/repo/vco-storage.sources"
rc=0; apt_in "$a" update >"$WORK/apt.log" 2>&1 || rc=$?
refused "$rc" "a repository signed by a key the source does not name" 'NO_PUBKEY|not signed'

# --- dnf ------------------------------------------------------------------------

# vco-agent requires shadow-utils, e2fsprogs and util-linux, which an empty
# root lacks and no RPM distribution's repository reachable here has: a
# stand-in package, from an unsigned local repository of the check's own,
# provides those names (and nothing else). Scriptlets do not run
# (tsflags=noscripts: the empty root has no shell); check-packages.sh runs
# them with rpm --root.
step "dnf: a stand-in for the distribution's packages vco-agent requires"
mkdir -p "$WORK/rpmbuild/SPECS" "$WORK/base"
cat >"$WORK/rpmbuild/SPECS/base.spec" <<-'EOF'
	Name: vco-check-distribution-standin
	Version: 1
	Release: 1
	Summary: Stands in for the RPM distribution's packages in check-repo.sh
	License: Apache-2.0
	BuildArch: noarch
	Provides: shadow-utils e2fsprogs util-linux
	%description
	Provides the names vco-agent requires, for an empty dnf --installroot.
	%files
EOF
rpmbuild --quiet --define "_topdir $WORK/rpmbuild" -bb "$WORK/rpmbuild/SPECS/base.spec" >/dev/null
cp "$WORK"/rpmbuild/RPMS/noarch/*.rpm "$WORK/base/"
createrepo_c --quiet "$WORK/base"

# dnf_in ROOT ARGS...: dnf confined to ROOT and its own cache, with the
# repository's vco-storage.repo and the stand-in repository.
dnf_in() {
	local r=$1
	shift
	dnf -y -q --installroot="$r" --releasever=12 --forcearch=x86_64 -c "$WORK/dnf/dnf.conf" \
		--setopt=reposdir="$WORK/dnf/repos" --setopt=cachedir="$WORK/dnf/cache" \
		--setopt=install_weak_deps=False --setopt=tsflags=noscripts "$@"
}
mkdir -p "$WORK/dnf/repos"
printf '[main]\nkeepcache=0\n' >"$WORK/dnf/dnf.conf"
cp "$REPO/vco-storage.repo" "$WORK/dnf/repos/"
printf '[standin]\nname=stand-in\nbaseurl=file://%s\ngpgcheck=0\nrepo_gpgcheck=0\n' "$WORK/base" >"$WORK/dnf/repos/standin.repo"

step "dnf: install vco-agent into an empty root (gpgcheck=1, repo_gpgcheck=1)"
for k in gpgcheck repo_gpgcheck; do
	grep -qx "$k=1" "$REPO/vco-storage.repo" || fail "vco-storage.repo does not set $k=1"
done
r=$WORK/rpmroot
mkdir "$r"
dnf_in "$r" install vco-agent >"$WORK/dnf.log" 2>&1 || { cat "$WORK/dnf.log"; fail "dnf install vco-agent failed"; }
cat "$WORK/dnf.log"
rpm --root "$r" -q vco-agent || fail "vco-agent is not installed in $r"
rpm --root "$r" -q gpg-pubkey --qf '%{VERSION}\n' | grep -qix "${fpr: -8}" || fail "dnf did not import the repository's key into $r"
[ -x "$r/usr/bin/vco-agent" ] || fail "$r/usr/bin/vco-agent is missing"
cmp "$r/usr/bin/vco-agent" <(rpm2cpio "$rpm_x86_64" | cpio -i --quiet --to-stdout ./usr/bin/vco-agent) ||
	fail "the installed vco-agent is not the one in $(basename "$rpm_x86_64")"

# dnf_refused WHAT PATTERN: dnf install into a fresh root fails with a
# message matching PATTERN and leaves vco-agent uninstalled.
dnf_refused() {
	local r=$WORK/rpmroot-$RANDOM rc=0
	mkdir "$r"
	rm -rf "$WORK/dnf/cache"
	dnf_in "$r" install vco-agent >"$WORK/dnf.log" 2>&1 || rc=$?
	[ "$rc" -ne 0 ] || { cat "$WORK/dnf.log"; fail "dnf installed $1"; }
	grep -Ei "$2" "$WORK/dnf.log" >&2 || { cat "$WORK/dnf.log"; fail "dnf refused $1, but not with '$2'"; }
	! rpm --root "$r" -q vco-agent >/dev/null 2>&1 || fail "dnf refused $1 but vco-agent is installed"
}
yum=$REPO/yum
cp -a "$yum" "$WORK/yum.good"
yrestore() { rm -rf "$yum" && cp -a "$WORK/yum.good" "$yum"; }
resign() { GNUPGHOME=$WORK/dist/.repo-throwaway-gnupg gpg --batch --yes --quiet --armor --detach-sign -o "$yum/repodata/repomd.xml.asc" "$yum/repodata/repomd.xml"; }

step "dnf: a tampered .rpm is refused (metadata regenerated and re-signed)"
yrpm=$yum/Packages/$(basename "$rpm_x86_64")
printf '\xff' | dd of="$yrpm" bs=1 seek=$(($(stat -c %s "$yrpm") - 100)) conv=notrunc status=none
rm -rf "$yum/repodata"
createrepo_c --quiet "$yum"
resign
dnf_refused "a tampered .rpm" 'GPG check FAILED'
yrestore

step "dnf: a tampered repomd.xml is refused"
sed -i 's|<revision>|<revision>1|' "$yum/repodata/repomd.xml"
cmp -s "$yum/repodata/repomd.xml" "$WORK/yum.good/repodata/repomd.xml" && fail "the check did not change repomd.xml"
dnf_refused "a tampered repomd.xml" 'repomd.xml GPG signature verification error'
yrestore

# --- the nodes' files -------------------------------------------------------------

step "the nodes' files name this repository, its key and its package"
VCO_REPO_DIR=$REPO VCO_REPO_URL=$URL VCO_IMAGE_BUILDER_DIR=$WORK/dist/image-builder \
	go test -count=1 -v -run '^TestBuiltRepository$' ./packaging/repo | tee "$WORK/go-test.log"
grep -q -- '^--- PASS: TestBuiltRepository' "$WORK/go-test.log" || fail "TestBuiltRepository did not pass"
cloud-init schema --config-file "$REPO/user-data.yaml"

step "repository OK"
