#!/bin/bash
# Makes the signed package repositories from the vco-agent packages in
# DIST (default dist/, made by `make packages`), in DIST/repo/:
#
#   apt/dists/stable/{Release,InRelease,Release.gpg}        apt-ftparchive, gpg
#   apt/dists/stable/main/binary-{amd64,arm64}/Packages{,.gz}
#   apt/pool/main/v/vco-agent/*.deb
#   yum/Packages/*.rpm                                       signed with rpmsign
#   yum/repodata/repomd.xml, repomd.xml.asc, ...             createrepo_c, gpg
#   vco-storage-archive-keyring.gpg, .asc                    the public key
#   vco-storage.sources, vco-storage.repo, user-data.yaml    for the nodes
#
# and DIST/image-builder/vco-agent-{deb,rpm}.json, image-builder's variables
# naming those source files by their absolute path on this machine.
#
# Packages already in the repository stay (a newer build is published next
# to them, and apt-get upgrade / dnf upgrade take it); every run regenerates
# all metadata and re-signs every package, so a new key signs everything.
#
# Environment:
#   REPO_SIGNING_KEY  path to an armored OpenPGP secret key without a
#                     passphrase (gpg --armor --export-secret-keys FPR); it is
#                     imported into a private GNUPGHOME that is removed at
#                     the end. Unset: a throwaway key, made once per DIST
#                     in DIST/.repo-throwaway-gnupg, with a warning.
#   VCO_REPO_URL      the URL DIST/repo/ will be served at, written into the
#                     node files (default: a placeholder to replace).
# Run from the repository root; `make repo` does.
set -euo pipefail

DIST=$(realpath "${1:-dist}")
ROOT=$(pwd)
REPO=$DIST/repo
URL=${VCO_REPO_URL:-https://REPLACE-WITH-REPOSITORY-HOST/vco-storage}
URL=${URL%/}
SUITE=stable
COMPONENT=main
KEYRING=vco-storage-archive-keyring

fail() { printf 'make-repo: %s\n' "$*" >&2; exit 1; }

for tool in apt-ftparchive createrepo_c gpg rpmsign; do
	command -v "$tool" >/dev/null || fail "$tool is not installed: run make deps-apt (apt-utils, createrepo-c, gpg, rpm)"
done
case $URL in
http://* | https://* | file://*) ;;
*) fail "VCO_REPO_URL=$URL: give the http://, https:// or file:// URL the repository will be served at" ;;
esac

shopt -s nullglob
debs=("$DIST"/vco-agent_*.deb)
rpms=("$DIST"/vco-agent-*.rpm)
shopt -u nullglob
[ ${#debs[@]} -gt 0 ] && [ ${#rpms[@]} -gt 0 ] ||
	fail "no vco-agent .deb and .rpm in $DIST: run make packages first"

# --- the signing key -----------------------------------------------------------

GNUPGHOME=
tmp_home=
cleanup() {
	[ -z "$GNUPGHOME" ] || gpgconf --homedir "$GNUPGHOME" --kill gpg-agent 2>/dev/null || true
	[ -z "$tmp_home" ] || rm -rf "$tmp_home"
}
trap cleanup EXIT

if [ -n "${REPO_SIGNING_KEY:-}" ]; then
	[ -f "$REPO_SIGNING_KEY" ] ||
		fail "REPO_SIGNING_KEY=$REPO_SIGNING_KEY is not a file: give the path of an armored secret key"
	tmp_home=$(mktemp -d /tmp/vco-repo-gnupg.XXXXXX)
	GNUPGHOME=$tmp_home
	gpg --homedir "$GNUPGHOME" --batch --quiet --import "$REPO_SIGNING_KEY" ||
		fail "gpg could not import REPO_SIGNING_KEY=$REPO_SIGNING_KEY"
	origin="REPO_SIGNING_KEY ($REPO_SIGNING_KEY)"
else
	GNUPGHOME=$DIST/.repo-throwaway-gnupg
	if [ ! -d "$GNUPGHOME" ]; then
		mkdir -m 0700 -p "$GNUPGHOME"
		gpg --homedir "$GNUPGHOME" --batch --quiet --pinentry-mode loopback --passphrase '' \
			--quick-generate-key 'vco-storage throwaway repository key (not for release) <vco-storage@localhost>' \
			rsa3072 sign never
	fi
	origin="a THROWAWAY key made for this build ($GNUPGHOME)"
fi
export GNUPGHOME

mapfile -t fprs < <(gpg --batch --trust-model always --with-colons --list-secret-keys | awk -F: '$1 == "sec" {s = 1; next} s && $1 == "fpr" {print $10; s = 0}')
[ ${#fprs[@]} -eq 1 ] || fail "want exactly one secret key in $origin, found ${#fprs[@]}"
FPR=${fprs[0]}
gpg() { command gpg --batch --yes --quiet --trust-model always --local-user "$FPR" "$@"; }

mkdir -p "$REPO"
gpg --export "$FPR" >"$REPO/$KEYRING.gpg"
gpg --armor --export "$FPR" >"$REPO/$KEYRING.asc"

# --- apt -----------------------------------------------------------------------

apt=$REPO/apt
pool=$apt/pool/$COMPONENT/v/vco-agent
mkdir -p "$pool"
cp -f "${debs[@]}" "$pool/"
rm -rf "$apt/dists"
for arch in amd64 arm64; do
	d=$apt/dists/$SUITE/$COMPONENT/binary-$arch
	mkdir -p "$d"
	(cd "$apt" && apt-ftparchive --arch "$arch" packages "pool/$COMPONENT") >"$d/Packages"
	grep -q "^Architecture: $arch\$" "$d/Packages" || fail "no $arch .deb in $DIST: make packages builds amd64 and arm64"
	gzip -9nk "$d/Packages"
done
(cd "$apt" && apt-ftparchive \
	-o APT::FTPArchive::Release::Origin=vco-storage \
	-o APT::FTPArchive::Release::Label=vco-storage \
	-o APT::FTPArchive::Release::Suite=$SUITE \
	-o APT::FTPArchive::Release::Codename=$SUITE \
	-o "APT::FTPArchive::Release::Architectures=amd64 arm64" \
	-o APT::FTPArchive::Release::Components=$COMPONENT \
	-o "APT::FTPArchive::Release::Description=vco-storage node packages (vco-agent)" \
	release "dists/$SUITE") >"$apt/Release.tmp"
mv "$apt/Release.tmp" "$apt/dists/$SUITE/Release"
gpg --digest-algo SHA512 --clearsign -o "$apt/dists/$SUITE/InRelease" "$apt/dists/$SUITE/Release"
gpg --digest-algo SHA512 --detach-sign -o "$apt/dists/$SUITE/Release.gpg" "$apt/dists/$SUITE/Release"

# --- yum -----------------------------------------------------------------------

yum=$REPO/yum
mkdir -p "$yum/Packages"
cp -f "${rpms[@]}" "$yum/Packages/"
# Debian's rpm names gpg2, which Debian does not install under that name.
rpmsign --define "__gpg $(type -P gpg)" --define "_gpg_path $GNUPGHOME" --define "_gpg_name $FPR" \
	--define '_gpg_digest_algo sha512' --define '_gpg_sign_cmd_extra_args --batch' \
	--addsign "$yum"/Packages/*.rpm >"$yum/rpmsign.log" 2>&1 ||
	{ cat "$yum/rpmsign.log" >&2; fail "rpmsign could not sign the packages in $yum/Packages"; }
rm "$yum/rpmsign.log"
rm -rf "$yum/repodata"
createrepo_c --quiet "$yum"
gpg --armor --detach-sign -o "$yum/repodata/repomd.xml.asc" "$yum/repodata/repomd.xml"

# --- the nodes' files ------------------------------------------------------------

# render TEMPLATE: ${VCO_REPO_URL} becomes the URL; a line holding only
# ${VCO_REPO_KEY} (after its indent) becomes the armored key at that
# indent, an empty key line written as "." where the indent is one space
# (deb822 continuation lines).
render() {
	awk -v url="$URL" -v keyfile="$REPO/$KEYRING.asc" '
		/^ *\$\{VCO_REPO_KEY\}$/ {
			ind = $0; sub(/\$\{VCO_REPO_KEY\}$/, "", ind)
			while ((getline k < keyfile) > 0) {
				if (k == "" && ind == " ") k = "."
				print (k == "" ? "" : ind k)
			}
			close(keyfile); next
		}
		{ gsub(/\$\{VCO_REPO_URL\}/, url); print }' "$1"
}
render "$ROOT/packaging/repo/vco-storage.sources" >"$REPO/vco-storage.sources"
render "$ROOT/packaging/repo/vco-storage.repo" >"$REPO/vco-storage.repo"
{
	cat "$ROOT/packaging/cloud-init/user-data.yaml"
	render "$ROOT/packaging/cloud-init/repository.yaml"
} >"$REPO/user-data.yaml"
mkdir -p "$DIST/image-builder"
for fmt in deb rpm; do
	sed "s|\${VCO_REPO_DIR}|$REPO|g" "$ROOT/deploy/image-builder/vco-agent-$fmt.json" >"$DIST/image-builder/vco-agent-$fmt.json"
done

# --- what was made ---------------------------------------------------------------

fpr_spaced=$(echo "$FPR" | sed -E 's/(.{4})/\1 /g; s/ $//')
echo "make-repo: $REPO signed by $origin"
echo "make-repo: key fingerprint $fpr_spaced"
echo "make-repo: apt: $(find "$pool" -name '*.deb' | wc -l) .deb; yum: $(find "$yum/Packages" -name '*.rpm' | wc -l) .rpm; nodes' files for $URL"
if [ -z "${REPO_SIGNING_KEY:-}" ]; then
	cat >&2 <<-EOF

		************************************************************************
		WARNING: $REPO is signed with a THROWAWAY key
		  ($fpr_spaced),
		made for this dist/ and kept in $GNUPGHOME. Nodes trusting it trust
		whoever copies that directory. For a release, set REPO_SIGNING_KEY to
		the path of the release key (docs/install.md, "The package repository").
		************************************************************************
	EOF
fi
