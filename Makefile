# vco-storage build, test and lab entry points; `make help` lists every
# target with one line each. The groups, in order: build, test tiers, lab,
# benchmarks, fuzz and soak, packaging, deps.
# `make test` and `make lab` install what they need through `make deps`.
# Each target has one rule; a line "## text" just above it is its line in
# `make help` (internal/makehelp checks that every target has one).

SHELL        := /bin/bash
.SHELLFLAGS  := -eu -o pipefail -c
GO           ?= go
MODULE       := github.com/whitesky-cloud/vco-storage
VERSION      ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
TOOLS        := $(CURDIR)/.tools/bin
BIN          := $(CURDIR)/bin
LDFLAGS      := -s -w -X main.version=$(VERSION)
CMDS         := vco-agent vco-csi vco-lab
export PATH  := $(TOOLS):$(PATH)

# Debian packages the tests and the lab use. Installed only when missing.
DEBS := protobuf-compiler libprotobuf-dev dbus qemu-system-x86 qemu-block-extra qemu-utils tgt \
        cryptsetup-bin busybox-static sg3-utils kmod cpio e2fsprogs xfsprogs util-linux jq \
        skopeo umoci gettext-base \
        lintian rpmlint rpm debootstrap cloud-init man-db groff-base \
        apt-utils createrepo-c dnf gpg gpg-agent curl python3

# Go tools, pinned.
STATICCHECK_VERSION     := v0.8.2
PROTOC_GEN_GO_VERSION   := v1.36.12
PROTOC_GEN_GRPC_VERSION := v1.6.0
CSI_SANITY_VERSION      := v5.6.0

##@ Build

.PHONY: all build proto clean help

## the binaries (the default goal)
all: build

## static vco-agent, vco-csi and vco-lab in bin/
build:
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ $(addprefix ./cmd/,$(CMDS))

## regenerates the agent API's Go code from agent/api/agent.proto
proto: deps
	protoc --proto_path=agent/api \
	  --plugin=protoc-gen-go=$(TOOLS)/protoc-gen-go \
	  --plugin=protoc-gen-go-grpc=$(TOOLS)/protoc-gen-go-grpc \
	  --go_out=agent/api --go_opt=paths=source_relative \
	  --go-grpc_out=agent/api --go-grpc_opt=paths=source_relative \
	  agent/api/agent.proto

## removes bin/ and dist/
clean:
	rm -rf $(BIN) dist

# `make help` prints the "##@" group lines and, under them, each target
# with the "## " line written just above its rule.
## lists every target with one line each
help:
	@awk '/^##@ /{printf "\n%s\n", substr($$0, 5); next} \
	  /^## /{d = substr($$0, 4); next} \
	  /^[A-Za-z0-9_-]+:([^=]|$$)/ {if (d != "") {t = $$0; sub(/:.*/, "", t); printf "  %-18s %s\n", t, d}} \
	  {d = ""}' $(firstword $(MAKEFILE_LIST))

##@ Test tiers (make test runs them in this order)

.PHONY: test unit lint test-bench-brief test-csi-sanity test-deploy test-lab test-crypt-lab \
        test-lease-lab test-udev-lab test-e2e test-faults test-packages test-repo test-k8s k8s-prefetch \
        vault-prefetch test-vault capi-prefetch

# Everything: lint, unit and host tests, then the later tiers as they land.
# The fuzz engine's runs (test-fuzz-brief, about 9 min) are in make fuzz
# and make soak, not here: the fuzz targets' seed corpora run in unit.
## every test tier below, in order, after deps, build, the background k8s-prefetch and lint
test: deps build k8s-prefetch lint unit test-bench-brief test-csi-sanity test-deploy \
      test-lab test-crypt-lab test-lease-lab test-udev-lab test-e2e test-faults test-packages test-repo test-k8s

# internal/cyclo holds every function, tests too, to a cyclomatic complexity
# of 20 at most, counted as gocyclo counts (a function over it is cut into
# named steps; the ones still over it are listed in the test).
## go vet, staticcheck and the complexity bar
lint: deps-go
	$(GO) vet ./...
	$(TOOLS)/staticcheck ./...
	$(GO) test -count=1 -run '^TestNo(Function|Test)OverTheBar$$' ./internal/cyclo

# make test starts this first: the Debian guest root (debootstrap, mostly
# downloads), the Kubernetes build and the sidecar images (about half an
# hour of CPU on a fresh machine) are made in the background at nice 10
# while the other tiers run; the tiers that need them wait for their
# locks. Its log: bin/k8s-prefetch.log.
## starts the guest root, Kubernetes build and images in the background
k8s-prefetch: build deps-apt
	@nohup nice -n 10 bash -c 'packaging/test/guest-root.sh >/dev/null & $(BIN)/vco-lab k8s prefetch; wait' >$(BIN)/k8s-prefetch.log 2>&1 </dev/null &

# The Vault server built from its sources (integration/vault/build, about
# 20 minutes of CPU the first time), in the background at nice 10 like
# k8s-prefetch, into /var/cache/vco-lab/vault/<version>-<digest>; a tier
# that needs it waits for its lock. Its log: bin/vault-prefetch.log.
## starts the Vault server's build in the background
vault-prefetch: build
	@nohup nice -n 10 $(BIN)/vco-lab vault prefetch >$(BIN)/vault-prefetch.log 2>&1 </dev/null &

# Cluster API's core manager built from its sources (integration/capi/build)
# with the release's CRDs, for K14 (soak-k8s-crs), in the background at
# nice 10 like vault-prefetch, into /var/cache/vco-lab/capi/<version>-<digest>;
# soak-k8s-crs waits for its lock. Its log: bin/capi-prefetch.log.
## starts Cluster API's core manager's build in the background
capi-prefetch: build
	@nohup nice -n 10 $(BIN)/vco-lab capi prefetch >$(BIN)/capi-prefetch.log 2>&1 </dev/null &

# Host tests run one package at a time: many attach loop devices and
# watch the kernel's block uevents, which are machine-wide.
## unit and host tests (go test ./..., one package at a time)
unit:
	$(GO) test -count=1 -p 1 -timeout 30m ./...

# Every benchmark once (-benchtime 1x), so that none hangs or breaks
# unseen between two `make bench` runs; the figures are not judged here.
# The packages are those with a Benchmark function, one at a time (many
# use loop devices). About 2 min.
BENCH_PKGS = $(shell git ls-files '*_test.go' | xargs grep -l '^func Benchmark' | xargs -n1 dirname | sort -u | sed 's|^|./|')
## every benchmark once, figures not judged
test-bench-brief: build
	VCO_AGENT_BIN=$(BIN)/vco-agent $(GO) test -count=1 -p 1 -timeout 20m -run '^$$' -bench . -benchtime 1x $(BENCH_PKGS)

# The csi-sanity binary against the built vco-agent, `vco-lab sim` (host
# backend) and `vco-csi --mode=all`, the agent mounting real loop devices,
# with filesystem and then raw block volumes; then the in-process suite
# with every volume encrypted, filesystem and then raw block.
## csi-sanity against the built binaries, then encrypted in process
test-csi-sanity: deps build
	VCO_CSI_SANITY=$(TOOLS)/csi-sanity VCO_BIN=$(BIN) $(GO) test -count=1 -run '^TestCSISanityBinary$$' ./cmd/vco-csi
	VCO_SANITY_ENCRYPTED=1 $(GO) test -count=1 -run '^TestSanity$$' ./csi/driver
	VCO_SANITY_ENCRYPTED=1 VCO_SANITY_BLOCK=1 $(GO) test -count=1 -run '^TestSanity$$' ./csi/driver

# Manifests decoded strictly and cross-checked; the image built, read back
# and opened with skopeo and umoci (installed by deps); vco-addon and make
# csi-addon's stdout.
## the manifest, image and add-on checks
test-deploy: deps
	VCO_DEPLOY_REQUIRE_TOOLS=1 $(GO) test -count=1 ./deploy/... ./cmd/vco-addon

# The guest tier: QEMU guests (TCG) sharing iSCSI LUNs served by tgtd on
# 127.0.0.1 (integration/). `go test ./...` skips it unless VCO_LAB is set.
LAB_TIMEOUT ?= 60m
E2E_PKGS := ./integration/simlab ./integration/e2e
## the guest tier: the lab's tests and the fencing scenarios in QEMU guests
test-lab: deps build
	VCO_LAB=1 VCO_LAB_BIN=$(BIN) $(GO) test -count=1 -p 1 -timeout $(LAB_TIMEOUT) \
	  $$($(GO) list ./integration/... | grep -v -e /integration/simlab -e /integration/e2e -e /integration/faults -e /integration/k8s)

# dm-crypt on a real guest kernel (crypt/dmcrypt/lab_test.go, 60-100 s):
# vco-agent luks format/open/close/resize against cryptsetup in a QEMU guest
# of the lab. Plain go test skips it unless VCO_LAB is set.
## real dm-crypt in a QEMU guest of the lab
test-crypt-lab: deps build
	VCO_LAB=1 VCO_LAB_BIN=$(BIN) $(GO) test -count=1 -p 1 -timeout 20m -run TestDMCryptInGuest ./crypt/dmcrypt/

# L1-L4 with the on-disk lease between two lab guests sharing one
# virtio-blk disk, through vco-agent lease (fence/lease/lab_test.go, 80 s).
## the on-disk lease between two lab guests
test-lease-lab: deps build
	VCO_LAB=1 VCO_LAB_BIN=$(BIN) $(GO) test -count=1 -p 1 -timeout 15m -run TestLeaseBetweenGuests ./fence/lease/

# The udev rules against real virtio-blk and QEMU SCSI disks in a lab guest
# (packaging/udev/lab_test.go, about 30 s).
## the udev rules in a lab guest
test-udev-lab: deps build
	VCO_LAB=1 VCO_LAB_BIN=$(BIN) $(GO) test -count=1 -p 1 -timeout 15m -run TestRulesInGuest ./packaging/udev/

# The end-to-end tier (guest tier too): the simulator in lab mode and the
# RWO story on two guests running vco-agent and the vco-csi node plugin;
# E9 boots a third, Debian 12 guest with the .deb under systemd.
## the RWO story's guest tests (E1-E9)
test-e2e: deps build packages guest-root
	VCO_LAB=1 VCO_LAB_BIN=$(BIN) $(GO) test -count=1 -p 1 -timeout $(LAB_TIMEOUT) $(E2E_PKGS)

# Faults injected in the lab (integration/faults, about 10 min): the
# iSCSI target restarted under a held disk, power cut during luksFormat and
# the agent's first stage (mkfs), 64 claimed disks and a burst of 200
# uevents on one guest. Lines "FIGURE name=value" go to the terminal and
# $(BIN)/faults.txt; `make soak-faults` repeats them FAULTS_SOAK_ROUNDS
# times each into $(BIN)/soak-faults.txt.
## faults injected in the lab, figures in bin/faults.txt
test-faults: deps build
	@mkdir -p $(BIN)
	VCO_LAB=1 VCO_LAB_BIN=$(BIN) $(GO) test -count=1 -p 1 -v -timeout 60m ./integration/faults | tee $(BIN)/faults.txt

# lintian, rpmlint, systemd-analyze, cloud-init schema, and install,
# upgrade, remove and purge in a debootstrap chroot and an rpm --root;
# then a Debian guest boots with the
# .deb and the cloud-init seed (first run: a debootstrap of about 900 MB,
# cached in /var/cache/vco-packaging; each run: two boots under TCG), and
# two guests from the plain root boot side by side with the repository's
# cloud-init user-data: one installs vco-agent from the signed repository,
# the other's InRelease is tampered and the install fails (one more boot).
## lints, installs, upgrades and purges the packages; boots guests with the .deb and from the repository
test-packages: deps packages
	packaging/test/check-packages.sh dist
	packaging/test/guest-boot.sh dist/vco-agent_*_amd64.deb

# make repo's output as nodes use it (packaging/test/check-repo.sh, about
# 30 s): built into a scratch directory with a throwaway key and with a
# REPO_SIGNING_KEY, served on 127.0.0.1; apt in a root of its own trusting
# only vco-storage.sources updates and downloads vco-agent, dnf installs it
# into an empty --installroot with gpgcheck and repo_gpgcheck; a tampered
# InRelease, Packages, .deb, .rpm or repomd.xml and a foreign key are each
# refused; the nodes' files name the repository, its key and the package.
## signed apt and yum repositories checked with apt and dnf, tampering refused
test-repo: deps-apt packages
	packaging/test/check-repo.sh dist

# The Kubernetes tier (docs/development.md, "The Kubernetes lab"): a
# cluster built from Kubernetes' sources (cached after the first build),
# workers as Debian 12 guests with the vco-agent package, the add-on
# applied with make csi-addon, scenarios K1, K2, K12 and K4 judged per safety
# property. make k8s-lab is the same from the command line, with its report
# in bin/k8s-report-*.txt and .html.
K8S_TIMEOUT ?= 70m
# K8S_SCENARIOS: empty for make test's (K1, K2, K12, K4), "all", or a list
# such as K1,K4,K6. K8S_KIND: the disk kind of k8s-lab's workers.
K8S_SCENARIOS ?=
K8S_KIND      ?= scsi-block
## a Kubernetes cluster built from source with the add-on, scenarios K1, K2, K12, K4
test-k8s: deps build packages guest-root
	$(MAKE) image IMAGE_ARCHS=amd64
	VCO_LAB=1 VCO_K8S=1 VCO_K8S_SCENARIOS=$(K8S_SCENARIOS) VCO_LAB_BIN=$(BIN) $(GO) test -count=1 -timeout $(K8S_TIMEOUT) -run '^TestStory$$' ./integration/k8s/story

# The Vault server built from its sources (vault-prefetch's build, waited
# for or made here) run as an operator runs it, not in dev mode: file
# storage, TLS from a CA of the test's own on 127.0.0.1, initialised,
# unsealed, transit and the Kubernetes auth method (integration/vault).
## a Vault server built from source: init, unseal, transit, Kubernetes auth
test-vault: build
	nice -n 10 $(BIN)/vco-lab vault prefetch
	VCO_VAULT=1 $(GO) test -count=1 -timeout 10m ./integration/vault

##@ Lab

.PHONY: lab k8s-lab guest-root

# The RWO story on the simulator in lab mode and two guests, once with
# scsi-block disks (reservations) and once with virtio-blk disks (the
# on-disk lease), each in a lab of its own; the text reports go to the
# terminal and bin/lab-report-KIND.txt, the timelines to
# bin/lab-report-KIND.html, with a verdict per kind at the end. Exits
# non-zero unless every safety property held on both kinds. E6, E7 and E9
# do not depend on the kind and run in the scsi-block story only.
# E6 (encrypted volume) wraps passphrases with the Vault server built from
# source (vault-prefetch starts its build in the background; on a machine
# without it cached the story waits about 25 minutes for it), which
# vco-lab starts on 127.0.0.1 with TLS. E9 runs in a Debian guest with the
# .deb under systemd when the Debian root is cached (make guest-root), else
# in a busybox guest.
## the RWO story on scsi-block and virtio-blk disks, with reports in bin/
lab: deps build packages vault-prefetch
	$(BIN)/vco-lab run -kind scsi-block,virtio-blk -report $(BIN)

# The Kubernetes lab of test-k8s from the command line (vco-lab k8s run)
# on K8S_KIND disks; its report in bin/k8s-report-*.txt and .html.
## the Kubernetes cluster and scenarios from the command line (vco-lab k8s run)
k8s-lab: deps build packages guest-root vault-prefetch
	$(MAKE) image IMAGE_ARCHS=amd64
	$(BIN)/vco-lab k8s run -bin $(BIN) -report $(BIN) -kind $(K8S_KIND)

# Kubernetes' own external storage suite (e2e.test of the pinned
# Kubernetes, -ginkgo.focus External.Storage) against deploy/testdriver.yaml
# on a cluster of its own (docs/development.md, "The storage suite"). FOCUS
# narrows the patterns (a Ginkgo regular expression within External.Storage,
# e.g. FOCUS='Dynamic PV \(ext4\)'), SKIP leaves specs out, K8S_E2E_CLASS
# picks the StorageClass, K8S_E2E_TIMEOUT bounds the suite (it then reports
# what ran); the summary in bin/k8s-e2e-KIND/.
FOCUS           ?=
SKIP            ?=
K8S_E2E_CLASS   ?=
K8S_E2E_TIMEOUT ?= 6h
.PHONY: k8s-e2e
## Kubernetes' external storage suite against deploy/testdriver.yaml (FOCUS, SKIP)
k8s-e2e: deps build packages guest-root
	$(MAKE) image IMAGE_ARCHS=amd64
	$(BIN)/vco-lab k8s e2e -bin $(BIN) -kind $(K8S_KIND) -focus '$(FOCUS)' -skip '$(SKIP)' -class '$(K8S_E2E_CLASS)' -suite-timeout $(K8S_E2E_TIMEOUT)

# The Debian 12 root that guest-boot.sh and E9's systemd guest boot: a
# debootstrap of about 900 MB, made once (about 14 min) and cached in
# /var/cache/vco-packaging (or $$VCO_PKG_CACHE).
## the cached Debian 12 guest root (debootstrap, once)
guest-root: deps-apt
	@packaging/test/guest-root.sh >/dev/null

##@ Benchmarks

.PHONY: bench bench-agent bench-csi bench-lab bench-fence bench-crypt

# Benchmarks print one table of figures against named references; they
# are never asserted. Each part is a bench-* target, a prerequisite of
# bench, that keeps its raw output in $(BIN)/bench-<part>.txt; the last
# step prints them all as one table (cmd/vco-bench; docs/benchmarks.md).
BENCH_PARTS := agent csi lab fence crypt
## every part below, then one table of all figures
bench: bench-agent bench-csi bench-lab bench-fence bench-crypt
	@echo; echo "== make bench: all parts, $$(date -u +%Y-%m-%d), $$(nproc) cores"
	@$(GO) run ./cmd/vco-bench $(foreach p,$(BENCH_PARTS),$(BIN)/bench-$(p).txt)

## the agent's daemon, events and volume benchmarks
bench-agent: deps build
	@{ VCO_AGENT_BIN=$(BIN)/vco-agent $(GO) test -count=1 -run '^$$' -bench . -benchtime 10x ./agent/daemon/ && \
	   $(GO) test -count=1 -run '^$$' -bench . -benchtime 200000x ./agent/events/ && \
	   $(GO) test -count=1 -run '^$$' -bench . -benchtime 5x ./agent/volume/ ; } > $(BIN)/bench-agent.txt; $(GO) run ./cmd/vco-bench $(BIN)/bench-agent.txt

# 100 concurrent CreateVolume+ControllerPublish against the simulator,
# reported as a ratio to the bare API calls for the same work; a node
# stage+unstage cycle on a loop device against plain mount+umount of it.
## the CSI driver against the bare API calls and plain mount
bench-csi: deps
	@mkdir -p $(BIN)
	$(GO) test -count=1 -run '^$$$$' -bench 'CreatePublish100|NodeStageUnstage' -benchtime 5x ./csi/driver | tee $(BIN)/bench-csi.txt

# Guest boot and lab set-up against a guest booting alone; reservation
# latency of the engine against sg_persist, in a guest; attach-to-staged
# (ControllerPublish to NodeStage done) against the same hot-plug then
# mkfs and mount by hand, per disk kind.
## guest boot, reservation latency and attach-to-staged in the lab
bench-lab: deps build
	@set -o pipefail 2>/dev/null; $(BIN)/vco-lab bench | tee $(BIN)/bench-lab.txt

# Lease takeover against its bound, a check of 64 claims against raw
# reads, refusal latency from the kernel's uevent against the 1 s budget
# (real loop devices; root).
## lease takeover, claim checks and refusal latency
bench-fence: deps
	@mkdir -p $(BIN)
	@{ $(GO) test -count=1 -run '^$$' -bench . -benchtime 3x ./fence/lease/ && \
	   $(GO) test -count=1 -run '^$$' -bench . -benchtime 20x ./fence/uevent/ ; } > $(BIN)/bench-fence.txt; $(GO) run ./cmd/vco-bench $(BIN)/bench-fence.txt

# LUKS2 unlock and format against cryptsetup with the same KDF cost.
## LUKS2 unlock and format against cryptsetup
bench-crypt: deps build
	@$(GO) test -count=1 -run '^$$' -bench . -benchtime 5x ./crypt/luks2/ > $(BIN)/bench-crypt.txt; $(GO) run ./cmd/vco-bench $(BIN)/bench-crypt.txt

# What the fence costs a user of the cluster: a claim to its first pod
# Running, a pod moved, a drain and K10's partition failover, fenced
# against the same cluster with the fence off (every agent's
# volumes.fence_methods [none] and the unfenced opt-in), the modes
# alternating on one cluster of its own (vco-lab k8s bench); about
# 25 min a round on TCG workers, so in make soak, on both disk kinds.
BENCH_K8S_ROUNDS ?= 1
.PHONY: bench-k8s soak-bench-k8s
## the cluster-level cost of the fence against the fence off (K8S_KIND)
bench-k8s: deps build packages guest-root
	$(MAKE) image IMAGE_ARCHS=amd64
	@set -o pipefail 2>/dev/null; $(BIN)/vco-lab k8s bench -bin $(BIN) -kind $(K8S_KIND) -rounds $(BENCH_K8S_ROUNDS) | tee $(BIN)/bench-k8s-$(K8S_KIND).txt && \
	  $(GO) run ./cmd/vco-bench $(BIN)/bench-k8s-$(K8S_KIND).txt

## the cluster bench on virtio-blk and scsi-block disks
soak-bench-k8s:
	@rc=0; \
	$(MAKE) --no-print-directory bench-k8s K8S_KIND=virtio-blk || rc=1; \
	$(MAKE) --no-print-directory bench-k8s K8S_KIND=scsi-block || rc=1; \
	exit $$rc

##@ Fuzz and soak

.PHONY: fuzz test-fuzz-brief fuzz-all fuzz-fence fuzz-crypt fuzz-smbios soak soak-faults soak-lease soak-volsim soak-upgrade soak-k8s soak-k8s-crs soak-k8s-e2e

# Every fuzz target in the repository, found with `go test -list`, each for
# FUZZTIME (default 30s); test-fuzz-brief runs each for FUZZBRIEF
# executions (a count: no deadline to race on a loaded machine). Checked-in corpora live in each package's testdata/fuzz.
FUZZTIME   ?= 30s
FUZZBRIEF ?= 3000x
FUZZ_PKGS  = $(shell grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u)
## every fuzz target for FUZZTIME (30s)
fuzz:
	@$(MAKE) --no-print-directory fuzz-all FUZZ_FOR=$(FUZZTIME) FUZZ_MIN=5s

## every fuzz target for FUZZBRIEF executions (3000x)
test-fuzz-brief:
	@$(MAKE) --no-print-directory fuzz-all FUZZ_FOR=$(FUZZBRIEF) FUZZ_MIN=0s

# Go 1.26's fuzz engine can end a timed run with a bare "context deadline
# exceeded" when -fuzztime expires mid-exec (golang/go#75804, fixed in
# 1.27); a real finding always writes a failing input, so only that fails.
## every fuzz target for FUZZ_FOR, minimising for FUZZ_MIN (fuzz and soak use it)
fuzz-all:
	@set -e; out=$$(mktemp); trap 'rm -f $$out' EXIT; n=0; for pkg in $(FUZZ_PKGS); do \
	  for fn in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "== $$pkg $$fn ($(FUZZ_FOR))"; n=$$((n+1)); \
	    if $(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZ_FOR) -fuzzminimizetime $(FUZZ_MIN) -parallel 1 $$pkg >$$out 2>&1; then cat $$out; \
	    elif grep -q 'context deadline exceeded' $$out && ! grep -q -e 'Failing input written' -e 'panic:' $$out; then \
	      cat $$out; echo "fuzz: $$fn stopped by the engine's end-of-run race (golang/go#75804), no failing input: not a finding"; \
	    else cat $$out; exit 1; fi; \
	  done; done; echo "fuzz: $$n targets, $(FUZZ_FOR) each"

# Fence parsers and the lease engine on arbitrary lease areas: each fuzz
# target for FUZZTIME (their seed corpora also run in `make unit`).
FENCE_FUZZ := fence:FuzzParseGrant fence:FuzzParseKey \
  fence/discovery:FuzzParseLocator fence/discovery:FuzzParsePCIAddress fence/discovery:FuzzParseDevnum \
  fence/scsi:FuzzParseSense fence/scsi:FuzzParseReadKeys fence/scsi:FuzzParseReadReservation \
  fence/scsi:FuzzParseReportCapabilities fence/scsi:FuzzParseReadFullStatus fence/scsi:FuzzParseInquiry \
  fence/scsi:FuzzParseUnitSerial fence/scsi:FuzzParseDeviceID \
  fence/lease:FuzzDecodeArea fence/lease:FuzzClassify fence/lease:FuzzLeaseEngine fence/lease:FuzzLeaseRetake fence/uevent:FuzzParse
## the fence parsers' and the lease engine's fuzz targets for FUZZTIME
fuzz-fence:
	@for t in $(FENCE_FUZZ); do pkg=$${t%%:*}; fn=$${t##*:}; echo "== $$pkg $$fn"; \
	  $(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 5s -parallel 1 ./$$pkg; done

# The LUKS2 header reader and metadata validator under the fuzzer.
## the LUKS2 header reader and metadata validator for 60s each
fuzz-crypt:
	$(GO) test -run '^$$' -fuzz FuzzReadHeader -fuzztime 60s ./crypt/luks2/
	$(GO) test -run '^$$' -fuzz FuzzParseMetadata -fuzztime 60s ./crypt/luks2/

# The SMBIOS table walker and parser, each for FUZZTIME.
## the SMBIOS table walker and parser for FUZZTIME
fuzz-smbios:
	@for fn in FuzzParseTable FuzzParseStructures; do echo "== smbios $$fn"; \
	  $(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) -parallel 1 ./smbios; done

# The long run, root, many hours; in this order:
#   deps-apt;
#   soak-k8s: the Kubernetes lab's every scenario on both disk kinds
#     (about 25 min each with warm caches);
#   soak-k8s-crs: K14, the add-on through a ClusterResourceSet, on a
#     cluster of its own (about 8 min with warm caches);
#   soak-faults: the lab's faults FAULTS_SOAK_ROUNDS times each (up to 4 h);
#   soak-lease: LEASE_SOAK_SEEDS lease schedules (up to 4 h);
#   soak-volsim: VOLSIM_SOAK_SEEDS volume manager sequences from another
#     range than make test's (about 20 min);
#   soak-upgrade: E9's package upgrade under write load UPGRADE_SOAK_ROUNDS
#     times on one staged lease volume (about 2 min each);
#   every fuzz target for FUZZTIME (log in $(BIN)/soak-fuzz.log);
#   TestConcurrentCSICalls under the race detector for STORM_RACE_ROUNDS
#     rounds;
#   the reliability tests (integration/reliability): the crash loop for
#     SOAK_ROUNDS rounds, STORM_SOAK_ROUNDS rounds of 100 concurrent CSI
#     calls and the others, their figures written to docs/reliability.md.
SOAK_ROUNDS ?= 200
# Rounds of 100 concurrent CSI calls (TestConcurrentCSICalls), and of the
# same under the race detector.
STORM_SOAK_ROUNDS ?= 20
STORM_RACE_ROUNDS ?= 5
## everything long: k8s and the storage suite on both kinds, fault and lease soaks, fuzzers, crash loop, races
soak: deps-apt soak-k8s soak-k8s-crs soak-k8s-e2e soak-bench-k8s soak-faults soak-lease soak-volsim soak-upgrade
	@mkdir -p $(BIN)
	$(MAKE) --no-print-directory fuzz-all FUZZ_FOR=$(FUZZTIME) FUZZ_MIN=5s 2>&1 | tee $(BIN)/soak-fuzz.log
	VCO_STORM_ROUNDS=$(STORM_RACE_ROUNDS) $(GO) test -race -count=1 -run TestConcurrentCSICalls ./integration/reliability
	VCO_CRASH_ROUNDS=$(SOAK_ROUNDS) VCO_STORM_ROUNDS=$(STORM_SOAK_ROUNDS) VCO_FUZZ_LOG=$(BIN)/soak-fuzz.log VCO_RELIABILITY_REPORT=$(CURDIR)/docs/reliability.md \
	  $(GO) test -count=1 -p 1 -timeout 90m -v ./integration/reliability | tee $(BIN)/soak.log | grep -E '^(=== RUN|--- |crash loop|ok|FAIL)|: storm: '
	@echo "soak: figures written to docs/reliability.md"

# The lab's faults (test-faults) FAULTS_SOAK_ROUNDS times each into
# $(BIN)/soak-faults.txt, its FIGURE lines printed at the end.
FAULTS_SOAK_ROUNDS ?= 10
## the lab's faults FAULTS_SOAK_ROUNDS (10) times each
soak-faults: deps build
	@mkdir -p $(BIN)
	VCO_LAB=1 VCO_LAB_BIN=$(BIN) VCO_FAULTS_ROUNDS=$(FAULTS_SOAK_ROUNDS) $(GO) test -count=1 -p 1 -v -timeout 4h ./integration/faults | tee $(BIN)/soak-faults.txt
	@grep -h '^FIGURE ' $(BIN)/soak-faults.txt

# The lease's schedule simulator (fence/lease/sim_test.go) over many more
# seeds than the unit tier's; a broken seed prints its replay command.
LEASE_SOAK_SEEDS ?= 40000
## LEASE_SOAK_SEEDS (40000) lease schedules in the simulator
soak-lease:
	$(GO) test -count=1 -timeout 4h -run 'TestLeaseSchedules$$' ./fence/lease -lease.from=100000 -lease.seeds=$(LEASE_SOAK_SEEDS)

# The volume manager simulation (agent/volume/sim_test.go) over many more
# seeds than the unit tier's, failing on its convergence invariant (I5) too.
VOLSIM_SOAK_SEEDS ?= 40000
## VOLSIM_SOAK_SEEDS (40000) volume manager sequences, I5 included
soak-volsim:
	$(GO) test -count=1 -timeout 4h -run 'TestVolumeSimulation$$' ./agent/volume -volsim.from=100000 -volsim.seeds=$(VOLSIM_SOAK_SEEDS)

# E9 of test-e2e with its package upgrade under write load repeated on the
# same staged lease volume: each round must resume the lease, fence nothing
# and fail no write (docs/upgrade.md).
UPGRADE_SOAK_ROUNDS ?= 20
## E9's package upgrade under load UPGRADE_SOAK_ROUNDS (20) times
soak-upgrade: deps build packages guest-root
	@mkdir -p $(BIN)
	VCO_LAB=1 VCO_LAB_BIN=$(BIN) VCO_E2E_UPGRADE_ROUNDS=$(UPGRADE_SOAK_ROUNDS) $(GO) test -count=1 -p 1 -v -timeout 2h -run TestAgentKilledDuringStage ./integration/e2e | tee $(BIN)/soak-upgrade.txt

# Every Kubernetes scenario on both disk kinds (about 25 min each with warm
# caches): scsi-block, and virtio-blk backed by files (the lab's virtio-blk
# disk that can grow under a running pod; K6).
## every Kubernetes scenario on scsi-block and on virtio-blk-file disks
soak-k8s:
	$(MAKE) --no-print-directory k8s-lab K8S_KIND=scsi-block
	$(MAKE) --no-print-directory k8s-lab K8S_KIND=virtio-blk-file

# K14 (docs/csi-addon.md, "Delivery through a ClusterResourceSet") on a
# scsi-block cluster of its own: Cluster API's core manager (built first
# unless cached: capi-prefetch) on the lab's control plane delivers the
# add-on to the lab cluster itself; report in bin/k8s-crs/.
## K14: the add-on delivered by a ClusterResourceSet, in a cluster of its own
soak-k8s-crs: deps build packages guest-root
	$(MAKE) image IMAGE_ARCHS=amd64
	nice -n 10 $(BIN)/vco-lab capi prefetch
	$(BIN)/vco-lab k8s run -bin $(BIN) -report $(BIN)/k8s-crs -kind scsi-block -cloud-init=false -scenarios K14

# Kubernetes' storage suite, every pattern deploy/testdriver.yaml selects
# (313 specs), on both disk kinds: hours each on TCG workers, so not in
# make test (docs/development.md, "The storage suite"). On scsi-block the
# lab skips the specs that grow a claim in use (tgtd cannot grow an
# attached iSCSI disk; the summary says so); virtio-blk-file runs them.
## Kubernetes' storage suite, every pattern, on scsi-block and virtio-blk-file disks
soak-k8s-e2e:
	@rc=0; \
	$(MAKE) --no-print-directory k8s-e2e K8S_KIND=scsi-block || rc=1; \
	$(MAKE) --no-print-directory k8s-e2e K8S_KIND=virtio-blk-file || rc=1; \
	exit $$rc

##@ Packaging

.PHONY: packages repo image csi-yaml csi-addon

# Node-image packages: dist/vco-agent_<version>_<arch>.deb and
# dist/vco-agent-<version>.<arch>.rpm for each of PKG_ARCHES.
PKG_ARCHES     := amd64 arm64
PKG_MAINTAINER ?= whitesky.cloud <vco-storage@whitesky.cloud>
comma          := ,
space          := $(subst x,,x x)
## the agent's .deb and .rpm in dist/ for amd64 and arm64
packages: build
	@rm -f dist/vco-agent_*.deb dist/vco-agent-*.rpm
	@for a in $(PKG_ARCHES); do \
	  CGO_ENABLED=0 GOOS=linux GOARCH=$$a $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/linux_$$a/ ./cmd/vco-agent; \
	done
	$(GO) run ./packaging/cmd/vco-pkg -version '$(VERSION)' -arch '$(subst $(space),$(comma),$(PKG_ARCHES))' \
	  -bin-dir '$(BIN)/linux_%s' -help-from $(BIN)/vco-agent -out dist -maintainer '$(PKG_MAINTAINER)'

# Signed apt and yum repositories of dist/'s packages in dist/repo/
# (packaging/repo/make-repo.sh; docs/install.md, "The package repository"):
# apt (suite stable, component main, amd64 and arm64) and yum, the public
# key as vco-storage-archive-keyring.gpg and .asc, and the nodes' files
# vco-storage.sources, vco-storage.repo and user-data.yaml for REPO_URL,
# the URL dist/repo/ will be served at; image-builder's variables in
# dist/image-builder/. REPO_SIGNING_KEY: the path of the armored secret
# release key; unset, a throwaway key kept in dist/.repo-throwaway-gnupg,
# with a warning. Packages already in dist/repo/ stay beside the new ones.
REPO_URL         ?=
REPO_SIGNING_KEY ?=
## signed apt and yum repositories of the packages in dist/repo/ (REPO_URL, REPO_SIGNING_KEY)
repo: deps-apt packages
	VCO_REPO_URL='$(REPO_URL)' REPO_SIGNING_KEY='$(REPO_SIGNING_KEY)' packaging/repo/make-repo.sh dist

# The vco-csi container image as an OCI image layout tarball, built
# without a container daemon: dist/vco-csi-<tag>.oci.tar, where the tag is
# the packages' version (v1.2.3 gives vco-csi:1.2.3 and vco-agent 1.2.3-1;
# internal/version, docs/upgrade.md).
IMAGE_ARCHS ?= amd64 arm64
## the vco-csi OCI image tarball in dist/
image:
	@mkdir -p $(BIN)/image dist
	for a in $(IMAGE_ARCHS); do \
	  CGO_ENABLED=0 GOOS=linux GOARCH=$$a $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/image/vco-csi-$$a ./cmd/vco-csi; done
	SOURCE_DATE_EPOCH=$$(git log -1 --format=%ct 2>/dev/null || echo 0) \
	  $(GO) run ./cmd/vco-addon image $(foreach a,$(IMAGE_ARCHS),-binary $(a)=$(BIN)/image/vco-csi-$(a)) \
	  -version $(VERSION) -out-dir dist

# deploy/csi.yaml, the add-on bundle with its two placeholders, and
# deploy/csi-snapshots.yaml and deploy/csi-encryption.yaml, the opt-in
# snapshots and encryption parts, from
# deploy/manifests (make test fails when they are stale).
## regenerates deploy/csi*.yaml from deploy/manifests
csi-yaml:
	$(GO) run ./cmd/vco-addon bundle -part core -o deploy/csi.yaml
	$(GO) run ./cmd/vco-addon bundle -part snapshots -o deploy/csi-snapshots.yaml
	$(GO) run ./cmd/vco-addon bundle -part encryption -o deploy/csi-encryption.yaml

# The add-on for one image, on stdout, so that
#   make csi-addon VCO_CSI_IMAGE=<host>/<path>:<tag> | kubectl apply -f -
# installs it; [VCO_CSI_DRIVER_NAME=...] overrides the driver name derived
# from the image's registry host, [VCO_AGENT_GID=...] the gid of the nodes'
# vco-agent group (573, as the packages make it), VCO_CSI_SNAPSHOTS=1 adds the snapshots
# part (the VolumeSnapshotClass: needs the snapshot CRDs) after the core
# (docs/csi-addon.md), VCO_CSI_ENCRYPTION=1 adds the encryption part (the
# encrypted class and the key backend's token reviewer: only with a key
# backend configured, docs/encryption.md). The files are kept in $(ADDON_DIR): csi.yaml and
# csi-snapshots.yaml with their placeholders, csi-addon.yaml and
# csi-snapshots-addon.yaml filled in. Every recipe line is silent (@):
# stdout carries the YAML only, notes go to stderr. From another directory
# use make -s -C <repo>: without -s, -C prints "Entering directory" lines
# on stdout.
VCO_CSI_IMAGE       ?=
VCO_CSI_DRIVER_NAME ?=
VCO_AGENT_GID       ?=
VCO_CSI_SNAPSHOTS   ?=
VCO_CSI_ENCRYPTION  ?=
ADDON_DIR           ?= dist
## the add-on for VCO_CSI_IMAGE on stdout (| kubectl apply -f -)
csi-addon:
	@test -n "$(VCO_CSI_IMAGE)" || { echo "make csi-addon: set VCO_CSI_IMAGE=<host>/<path>:<tag>" >&2; exit 2; }
	@case '$(VCO_CSI_SNAPSHOTS)' in ''|0|false|no|1|true|yes) ;; \
	  *) echo "make csi-addon: VCO_CSI_SNAPSHOTS='$(VCO_CSI_SNAPSHOTS)': use 1 (add the snapshots part) or leave it empty" >&2; exit 2;; esac
	@case '$(VCO_CSI_ENCRYPTION)' in ''|0|false|no|1|true|yes) ;; \
	  *) echo "make csi-addon: VCO_CSI_ENCRYPTION='$(VCO_CSI_ENCRYPTION)': use 1 (add the encryption part) or leave it empty" >&2; exit 2;; esac
	@mkdir -p $(BIN) '$(ADDON_DIR)'
	@CGO_ENABLED=0 $(GO) build -o $(BIN)/vco-addon ./cmd/vco-addon
	@$(BIN)/vco-addon bundle -part core -o '$(ADDON_DIR)/csi.yaml'
	@$(BIN)/vco-addon bundle -part snapshots -o '$(ADDON_DIR)/csi-snapshots.yaml'
	@$(BIN)/vco-addon render -part core -image '$(VCO_CSI_IMAGE)' -driver-name '$(VCO_CSI_DRIVER_NAME)' -agent-gid '$(VCO_AGENT_GID)' -o '$(ADDON_DIR)/csi-addon.yaml'
	@$(BIN)/vco-addon render -part snapshots -image '$(VCO_CSI_IMAGE)' -driver-name '$(VCO_CSI_DRIVER_NAME)' -agent-gid '$(VCO_AGENT_GID)' -o '$(ADDON_DIR)/csi-snapshots-addon.yaml'
	@$(BIN)/vco-addon bundle -part encryption -o '$(ADDON_DIR)/csi-encryption.yaml'
	@$(BIN)/vco-addon render -part encryption -image '$(VCO_CSI_IMAGE)' -driver-name '$(VCO_CSI_DRIVER_NAME)' -agent-gid '$(VCO_AGENT_GID)' -o '$(ADDON_DIR)/csi-encryption-addon.yaml'
	@case '$(VCO_CSI_SNAPSHOTS)' in \
	  1|true|yes) cat '$(ADDON_DIR)/csi-addon.yaml' '$(ADDON_DIR)/csi-snapshots-addon.yaml'; \
	    echo "make csi-addon: stdout: $(ADDON_DIR)/csi-addon.yaml and $(ADDON_DIR)/csi-snapshots-addon.yaml (the snapshots part needs the snapshot CRDs and snapshot-controller)" >&2;; \
	  *) cat '$(ADDON_DIR)/csi-addon.yaml'; \
	    echo "make csi-addon: stdout: $(ADDON_DIR)/csi-addon.yaml; the snapshots part, $(ADDON_DIR)/csi-snapshots-addon.yaml, is not included (VCO_CSI_SNAPSHOTS=1 adds it; docs/csi-addon.md)" >&2;; esac
	@case '$(VCO_CSI_ENCRYPTION)' in \
	  1|true|yes) cat '$(ADDON_DIR)/csi-encryption-addon.yaml'; \
	    echo "make csi-addon: stdout: and $(ADDON_DIR)/csi-encryption-addon.yaml (the encrypted class: needs the key backend's ConfigMaps, docs/encryption.md)" >&2;; \
	  *) echo "make csi-addon: the encryption part, $(ADDON_DIR)/csi-encryption-addon.yaml, is not included (VCO_CSI_ENCRYPTION=1 adds it once a key backend is configured; docs/encryption.md)" >&2;; esac

##@ Deps

.PHONY: deps deps-apt deps-go deps-lab deps-udev

## every dependency below
deps: deps-apt deps-go deps-lab deps-udev

## the Debian packages in DEBS that are missing
deps-apt:
	@missing=""; \
	for p in $(DEBS); do \
	  dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed$$' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

## the pinned Go tools in .tools/bin
deps-go:
	@mkdir -p $(TOOLS)
	@test -x $(TOOLS)/staticcheck || GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	@test -x $(TOOLS)/protoc-gen-go || GOBIN=$(TOOLS) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	@test -x $(TOOLS)/protoc-gen-go-grpc || GOBIN=$(TOOLS) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GRPC_VERSION)
	@test -x $(TOOLS)/csi-sanity || GOBIN=$(TOOLS) $(GO) install github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$(CSI_SANITY_VERSION)

# The lab's guest kernel: Debian's linux-image-amd64, unpacked into
# /var/cache/vco-lab (or $$VCO_LAB_CACHE) once.
## the lab's guest kernel
deps-lab: deps-apt
	@apt-cache show linux-image-amd64 >/dev/null 2>&1 || apt-get update -qq
	@$(GO) run ./cmd/vco-lab prepare

# A udevadm for the rules tests, unpacked from Debian's packages into
# .tools/udev without installing them: installing udev would start a
# daemon that reacts to every loop device the tests attach.
UDEV_ROOT := $(CURDIR)/.tools/udev
## a udevadm for the udev rules' tests, unpacked, never installed
deps-udev: deps-apt
	@test -x $(UDEV_ROOT)/bin/udevadm || { apt-cache show udev >/dev/null 2>&1 || apt-get update -qq; \
	  d=$$(mktemp -d) && cd $$d && \
	  apt-get download -q udev libsystemd-shared >/dev/null && \
	  mkdir -p $(UDEV_ROOT) && for f in *.deb; do dpkg-deb -x $$f $(UDEV_ROOT); done && rm -rf $$d; }
