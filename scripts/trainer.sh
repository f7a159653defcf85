#!/usr/bin/env bash
# Builds (cold) or reuses (warm) Kubeflow Trainer v2 for the end-to-end tests: the JobSet controller and
# Trainer's controller manager, built from the Go module proxy with the machine's Go, as
# scripts/control-plane.sh builds the rest of the test cluster, and the manifests the tests install,
# copied from the same modules. Everything is cached under ~/.cache/trainguard/ (or $TRAINGUARD_CACHE):
#
#   bin/trainer-<key>/jobset                     JobSet's controller manager (the module's root package)
#   bin/trainer-<key>/trainer-controller-manager Trainer's (cmd/trainer-controller-manager); <key>
#                                                hashes both versions: a bump builds afresh
#   kubeflow/trainer-<version>/                  Trainer's CRDs (manifests/base/crds), its shipped
#                                                torch-distributed ClusterTrainingRuntime
#                                                (manifests/base/runtimes) and webhook configurations
#                                                (manifests/base/webhook)
#   kubeflow/jobset-<version>/                   JobSet's CRD (config/components/crd/bases) and webhook
#                                                configurations (config/components/webhook)
#   go/{mod,build,path}                          shared with scripts/control-plane.sh and scripts/tools.sh
#
# Versions: Trainer v2.3.0 is the newest release; its go.mod requires sigs.k8s.io/jobset v0.12.0, which
# is therefore the JobSet controller built (checked against that go.mod). Neither module has replace
# directives; both build in one wrapper module (see build below).
#
# Usage:
#   bash scripts/trainer.sh [build]        build and fetch what is missing; print the bin directory
#   bash scripts/trainer.sh --bin-dir      print the bin directory only (builds nothing)
#   bash scripts/trainer.sh --trainer-dir  print Trainer's manifests directory only (fetches nothing)
#   bash scripts/trainer.sh --jobset-dir   print JobSet's manifests directory only (fetches nothing)
#
# Everything but the final path goes to stderr, with the time each phase took. Idempotent, and safe to
# run concurrently (a lock serialises the builds).
set -euo pipefail

TRAINER_VERSION=v2.3.0
JOBSET_VERSION=v0.12.0

cache=${TRAINGUARD_CACHE:-$HOME/.cache/trainguard}
key=$(printf 'trainer %s\njobset %s\nbuilt together\n' "$TRAINER_VERSION" "$JOBSET_VERSION" | sha256sum | cut -c1-12)
bin_dir="$cache/bin/trainer-$key"
trainer_dir="$cache/kubeflow/trainer-$TRAINER_VERSION"
jobset_dir="$cache/kubeflow/jobset-$JOBSET_VERSION"

case "${1:-build}" in
  --bin-dir) echo "$bin_dir" && exit 0 ;;
  --trainer-dir) echo "$trainer_dir" && exit 0 ;;
  --jobset-dir) echo "$jobset_dir" && exit 0 ;;
  build) ;;
  *)
    echo "usage: bash scripts/trainer.sh [build | --bin-dir | --trainer-dir | --jobset-dir]" >&2
    exit 2
    ;;
esac

log() { printf 'trainer: %s\n' "$*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }

command -v go >/dev/null || {
  log "error: go is not on PATH (Trainer and JobSet are built from the Go module proxy)"
  exit 1
}

export GOPATH="$cache/go/path"
export GOMODCACHE="$cache/go/mod"
export GOCACHE="$cache/go/build"
export GOTOOLCHAIN=local # build with the machine's Go; never fetch another toolchain silently
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
mkdir -p "$cache/bin" "$cache/kubeflow" "$GOPATH" "$GOMODCACHE" "$GOCACHE"

total=$(now)

# module_dir MODULE@VERSION: where the module cache holds its (read-only) tree; downloads it if needed.
module_dir() {
  (cd "${TMPDIR:-/tmp}" && go mod download -json "$1") | sed -n 's/.*"Dir": "\(.*\)".*/\1/p'
}

# copy_manifests MODULE@VERSION DEST SRC:NAME...: the files SRC of the module's tree as DEST/NAME, in a
# temp dir renamed into place (a copy interrupted or run twice at once leaves a whole directory or none).
copy_manifests() {
  local module=$1 dest=$2 started dir tmp entry src name missing=""
  shift 2
  for entry in "$@"; do
    if [ ! -f "$dest/${entry#*:}" ]; then missing+=" ${entry#*:}"; fi
  done
  if [ -z "$missing" ]; then
    log "$module manifests: cached in $dest"
    return 0
  fi
  started=$(now)
  dir=$(module_dir "$module")
  tmp=$(mktemp -d "$dest.XXXXXX")
  for entry in "$@"; do
    src=${entry%%:*} name=${entry#*:}
    if [ -z "$dir" ] || [ ! -f "$dir/$src" ]; then
      rm -rf "$tmp"
      log "error: $module has no $src in the module cache"
      return 1
    fi
    cp "$dir/$src" "$tmp/$name"
  done
  chmod 755 "$tmp"
  chmod 644 "$tmp"/*
  rm -rf "$dest"
  mv -T "$tmp" "$dest" 2>/dev/null || rm -rf "$tmp" # another copy won the race: keep its files
  log "$module manifests: copied in $(since "$started") into $dest"
}

crds=manifests/base/crds/trainer.kubeflow.org
copy_manifests "github.com/kubeflow/trainer/v2@$TRAINER_VERSION" "$trainer_dir" \
  "${crds}_clustertrainingruntimes.yaml:trainer.kubeflow.org_clustertrainingruntimes.yaml" \
  "${crds}_trainingruntimes.yaml:trainer.kubeflow.org_trainingruntimes.yaml" \
  "${crds}_trainjobs.yaml:trainer.kubeflow.org_trainjobs.yaml" \
  manifests/base/runtimes/torch_distributed.yaml:torch_distributed.yaml \
  manifests/base/webhook/manifests.yaml:webhooks.yaml \
  manifests/base/webhook/patch_validating.yaml:webhooks-validating-patch.yaml
copy_manifests "sigs.k8s.io/jobset@$JOBSET_VERSION" "$jobset_dir" \
  config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml:jobset.x-k8s.io_jobsets.yaml \
  config/components/webhook/manifests.yaml:webhooks.yaml \
  config/components/webhook/patches/mutating-patch.yaml:webhooks-mutating-patch.yaml \
  config/components/webhook/patches/validating-patch.yaml:webhooks-validating-patch.yaml

# One builder at a time (a developer's shell and CI may start together); the loser reuses the binaries.
exec 9>"$cache/bin/.trainer.lock"
if command -v flock >/dev/null; then
  flock 9
fi

# Both binaries in one `go build`, as dependencies of a small wrapper module made in a temp dir outside the
# clone that requires Trainer alone: JobSet is built in Trainer's module graph, the one Trainer is tested
# against, so its dependencies are at Trainer's (patch-newer) versions and every package the two share
# (client-go, controller-runtime, the APIs: most of either) compiles once. Measured on 2 shared cores,
# empty caches (downloads included): 329.3 s for both; built apart, side by side with the control
# plane's build, they took 602.6 s (JobSet) and 511.3 s (Trainer).
# (`go install pkg@version` is no option: it lists the module's versions to look for a deprecation,
# which the Go module proxy reached here refuses with 403.) Into a temp dir, then an atomic rename into
# bin/trainer-<key>/, so an interrupted build leaves nothing half-made behind.
build() {
  local started tmp work go_line required gomod
  if [ -x "$bin_dir/jobset" ] && [ -x "$bin_dir/trainer-controller-manager" ]; then
    log "jobset $JOBSET_VERSION, trainer-controller-manager $TRAINER_VERSION: cached in $bin_dir"
    return 0
  fi
  started=$(now)
  gomod=$(cd "${TMPDIR:-/tmp}" && go mod download -json "github.com/kubeflow/trainer/v2@$TRAINER_VERSION" |
    sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  required=$(sed -n 's#^[[:space:]]*sigs\.k8s\.io/jobset \(v[^ ]*\).*#\1#p' "$gomod")
  if [ "$required" != "$JOBSET_VERSION" ]; then
    log "error: Trainer $TRAINER_VERSION requires sigs.k8s.io/jobset ${required:-(none)}, not $JOBSET_VERSION"
    return 1
  fi
  go_line=$(grep -m1 '^go ' "$gomod")
  work=$(mktemp -d "${TMPDIR:-/tmp}/trainguard-build-trainer.XXXXXX")
  printf 'module trainguard.invalid/build/trainer\n\n%s\n\nrequire github.com/kubeflow/trainer/v2 %s\n' \
    "$go_line" "$TRAINER_VERSION" >"$work/go.mod"
  log "jobset $JOBSET_VERSION, trainer-controller-manager $TRAINER_VERSION: go build (cold machine: several minutes)"
  tmp=$(mktemp -d "$cache/bin/.trainer-$key.XXXXXX")
  chmod 755 "$tmp"
  # JobSet's main package is its module's root; its version is stamped as its Makefile does.
  if ! (cd "$work" && go build -trimpath -o "$tmp/" \
    -ldflags "-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion=$JOBSET_VERSION" \
    sigs.k8s.io/jobset github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager); then
    rm -rf "$tmp" "$work"
    log "error: building JobSet $JOBSET_VERSION and Trainer $TRAINER_VERSION failed (see above)"
    return 1
  fi
  rm -rf "$bin_dir" "$work"
  mv "$tmp" "$bin_dir"
  log "jobset $JOBSET_VERSION, trainer-controller-manager $TRAINER_VERSION: built in $(since "$started")"
}

build
log "ready in $(since "$total")"
echo "$bin_dir"
