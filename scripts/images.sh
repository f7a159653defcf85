#!/usr/bin/env bash
# Builds (cold) or reuses (warm) the container images of the test node, daemonless (buildah, no registry),
# and imports them into a containerd. Each image is an OCI archive under ~/.cache/trainguard/images/ (or
# $TRAINGUARD_CACHE), named by a hash of everything it is made from, so an unchanged input is never built
# twice and a warm run takes seconds:
#
#   base          Debian bookworm with python3, its venv module and libstdc++ (mmdebstrap, from the machine's own
#                 apt sources); the FROM of the others, in place of the public python:3.11-slim
#   pause         the base, sleeping: containerd's pod sandbox image
#   trainguard    images/trainguard.Dockerfile: the operator and the sidecar, no torch
#   pytorch       images/pytorch.Dockerfile: the stand-in for a user's PyTorch image (the project's
#                 locked torch, CPU only)
#   worker        images/worker.Dockerfile on pytorch: the guardian library added
#   tiny-lm       images/tiny-lm.Dockerfile on worker: the example's image
#   coredns       images/coredns.Dockerfile: CoreDNS as scripts/control-plane.sh builds it
#   pytorch-init  images/pytorch-init.Dockerfile: Debian's static busybox, for the training operator's
#                 worker init container (sh, seq, nslookup)
#
# Usage:
#   bash scripts/images.sh [build]          build what is missing; print the manifest's path on stdout
#   bash scripts/images.sh --manifest       print the manifest's path only (builds nothing)
#   bash scripts/images.sh prebuild         build every image but coredns, which needs the binary
#                                           scripts/control-plane.sh builds (so the two can run side by
#                                           side: .ci/run); prints nothing on stdout, writes no manifest
#   bash scripts/images.sh import ADDRESS   import every image of the manifest into the containerd at
#                                           ADDRESS (its socket), namespace k8s.io, unless it holds it
#   bash scripts/images.sh push REGISTRY [TAG]
#                                           build what is missing, then push the images a cluster runs,
#                                           trainguard (operator and sidecar) and tiny-lm (the example's
#                                           worker), as REGISTRY/trainguard:TAG and REGISTRY/tiny-lm:TAG
#                                           (TAG: the chart's appVersion by default), with skopeo, which
#                                           copies the archives' blobs as they are; print the references.
#                                           skopeo logs in as `skopeo login` (or `docker login`) left it.
#
# The manifest (images/manifest-<key>.json) maps each name to its reference (trainguard.local/NAME:KEY)
# and archive. Everything but the final path goes to stderr, with the time each phase took. Needs root
# (buildah's storage and mounts); apt-get installs buildah, mmdebstrap, busybox-static and skopeo when missing. Safe to run
# concurrently (a lock serialises the builds).
set -euo pipefail

SUITE=bookworm
# libstdc++6: the Python images people build FROM have it, and torch needs it.
BASE_PACKAGES=python3,python3-venv,libstdc++6
# Bump to rebuild every image (a change of this script's recipe that no input hash would see).
RECIPE=1

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${TRAINGUARD_CACHE:-$HOME/.cache/trainguard}
out="$cache/images"
mode=${1:-build}

log() { printf 'images: %s\n' "$*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
# apt-get, one at a time among this repository's scripts (.ci/run runs them side by side): apt's own
# locks make a second apt-get fail rather than wait.
apt_locked() {
  mkdir -p "$cache"
  if command -v flock >/dev/null; then flock "$cache/.apt.lock" "$@"; else "$@"; fi
}
hash() { sha256sum | cut -c1-12; }

# hash_files PATH...: a hash of the files' names and contents (directories recursively, caches skipped).
hash_files() {
  (cd "$root" && find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum) | hash
}

# Building needs root and three Debian packages, pushing a fourth (skopeo), all installed at the first
# build, before the keys are computed (one of them hashes the busybox binary).
if [ "$mode" = build ] || [ "$mode" = prebuild ] || [ "$mode" = push ]; then
  if [ "$(id -u)" != 0 ]; then
    log "error: building the images needs root (buildah's storage mounts overlays)"
    exit 1
  fi
  missing=""
  command -v buildah >/dev/null || missing+=" buildah"
  command -v mmdebstrap >/dev/null || missing+=" mmdebstrap"
  dpkg -s busybox-static >/dev/null 2>&1 || missing+=" busybox-static"
  command -v skopeo >/dev/null || missing+=" skopeo" # for push; installed with the rest, before a test needs it
  if [ -n "$missing" ]; then
    started=$(now)
    log "installing Debian's packages:$missing"
    # shellcheck disable=SC2086 # one word per package
    apt_locked apt-get update -qq >&2 && apt_locked apt-get install -y -qq --no-install-recommends $missing >&2
    log "installed in $(since "$started")"
  fi
fi

python=${PYTHON:-$root/.venv/bin/python}
coredns_bin="$(bash "$root/scripts/control-plane.sh" --bin-dir)/coredns"
coredns_sum=$(sha256sum <"$coredns_bin" 2>/dev/null || echo missing)

# The keys: each image's inputs, and the key of the image it is built FROM.
base_key=$(printf 'recipe %s\nsuite %s\npackages %s\n' "$RECIPE" "$SUITE" "$BASE_PACKAGES" | hash)
pause_key=$(printf 'base %s\n' "$base_key" | hash)
# README.md is only the wheel's long description: editing it rebuilds nothing.
wheel_key=$(hash_files pyproject.toml operator trainer_sidecar trainguard)
trainguard_key=$( (echo "base $base_key wheel $wheel_key"; cd "$root" &&
  cat images/trainguard.Dockerfile images/trainguard-requirements.txt requirements.lock) | hash)
# torch and every distribution it requires (with the extras it asks for), as installed in the project's
# environment: what `pip install torch==<the locked version>` brings, CUDA libraries included (the PyPI
# build of torch does not import without them, even on a machine with no GPU).
torch_closure() {
  "$python" - "$@" <<'PY'
import os, shutil, sys
from importlib.metadata import distribution
from packaging.requirements import Requirement

found, todo = {}, [("torch", "")]
while todo:
    name, extra = todo.pop()
    dist = distribution(name)
    key = (dist.metadata["Name"].lower().replace("_", "-"), extra)
    if key in found:
        continue
    found[key] = dist
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
            todo += [(requirement.name, "")] + [(requirement.name, e) for e in requirement.extras]
dists = {dist.metadata["Name"]: dist for dist in found.values()}
if len(sys.argv) == 1:  # the versions, for the image's key
    print(" ".join(sorted(f"{name}=={dist.version}" for name, dist in dists.items())))
    sys.exit()
target = sys.argv[1]  # stage each distribution's own files (its RECORD), hard-linked, into target
for dist in dists.values():
    for file in dist.files or []:
        source = dist.locate_file(file)
        if ".." in file.parts or file.suffix == ".pyc" or not os.path.isfile(source):
            continue  # console scripts outside site-packages; byte code
        destination = os.path.join(target, *file.parts)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        try:
            os.link(source, destination)
        except OSError:
            shutil.copy2(source, destination)
PY
}
torch_versions=$(torch_closure 2>/dev/null || echo unknown)
pytorch_key=$( (echo "base $base_key torch $torch_versions"; cat "$root/images/pytorch.Dockerfile") | hash)
worker_key=$( (echo "pytorch $pytorch_key wheel $wheel_key"; cd "$root" &&
  cat images/worker.Dockerfile images/worker-requirements.txt requirements.lock) | hash)
tiny_lm_key=$( (echo "worker $worker_key examples $(hash_files examples/tiny_lm examples/04_fsdp)"
  cat "$root/images/tiny-lm.Dockerfile") | hash)
coredns_key=$( (echo "coredns $coredns_sum"
  cat "$root/images/coredns.Dockerfile") | hash)
BUSYBOX=/bin/busybox # Debian's busybox-static
busybox_sum=$(sha256sum <"$BUSYBOX" 2>/dev/null || echo missing)
init_key=$( (echo "busybox $busybox_sum"; cat "$root/images/pytorch-init.Dockerfile") | hash)
NAMES="base pause trainguard pytorch worker tiny-lm coredns pytorch-init"
# The images the node runs, saved as archives and imported (the base too: the tests' image that runs as
# root); the others are only built FROM, and stay in buildah's storage.
IMPORTED="base pause trainguard tiny-lm coredns pytorch-init"
declare -A KEY=([base]=$base_key [pause]=$pause_key [trainguard]=$trainguard_key [pytorch]=$pytorch_key
  [worker]=$worker_key [tiny-lm]=$tiny_lm_key [coredns]=$coredns_key [pytorch-init]=$init_key)
ref() { echo "trainguard.local/$1:${KEY[$1]}"; }
archive() { echo "$out/$1-${KEY[$1]}.oci.tar"; }
manifest="$out/manifest-$(for n in $IMPORTED; do echo "$n ${KEY[$n]}"; done | hash).json"

case "$mode" in
  --manifest)
    echo "$manifest"
    exit 0
    ;;
  build | import | prebuild) ;;
  push)
    registry=${2:?usage: bash scripts/images.sh push REGISTRY [TAG]}
    registry=${registry%/}
    tag=${3:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$root/charts/trainguard/Chart.yaml")}
    ;;
  *)
    echo "usage: bash scripts/images.sh [build | --manifest | prebuild | import ADDRESS | push REGISTRY [TAG]]" >&2
    exit 2
    ;;
esac

if [ "$mode" = import ]; then
  address=${2:?usage: bash scripts/images.sh import ADDRESS}
  [ -f "$manifest" ] || { log "error: $manifest is missing: run bash scripts/images.sh"; exit 1; }
  total=$(now)
  present=$(ctr --address "$address" --namespace k8s.io images list --quiet)
  for name in $IMPORTED; do
    if grep -qxF "$(ref "$name")" <<<"$present"; then
      log "$name: $(ref "$name") already in $address"
      continue
    fi
    started=$(now)
    # The archive's index names the image by its full reference (buildah's org.opencontainers.image.ref.name).
    ctr --address "$address" --namespace k8s.io images import "$(archive "$name")" >&2
    log "$name: imported $(ref "$name") in $(since "$started")"
  done
  # Images of other keys (an earlier build) go: containerd's garbage collector then frees their layers
  # (several GB for each tiny-lm), which the kubelet, told never to collect images, would keep forever.
  wanted=$(for name in $IMPORTED; do ref "$name"; done)
  for stale in $(grep '^trainguard\.local/' <<<"$present" | grep -vxF "$wanted" || true); do
    ctr --address "$address" --namespace k8s.io images remove "$stale" >/dev/null
    log "removed $stale"
  done
  log "all images in $address in $(since "$total")"
  exit 0
fi

[ "$torch_versions" != unknown ] || { log "error: no torch in $python: run bash scripts/bootstrap.sh"; exit 1; }

mkdir -p "$out"
exec 9>"$out/.lock"
flock 9
total=$(now)

# buildah's own storage, beside the archives: layers of a build are reused by the next one.
buildah_() {
  buildah --root "$cache/buildah/storage" --runroot "$cache/buildah/run" --storage-driver overlay "$@"
}
work=""
cleanup() { if [ -n "$work" ]; then rm -rf "$work"; fi; }
trap cleanup EXIT
work=$(mktemp -d "$out/.work.XXXXXX")

# save NAME: an imported image, from buildah's storage to its archive, atomically (the intermediate ones
# stay in the storage only).
save() {
  local name=$1 tmp
  if [[ " $IMPORTED " != *" $name "* ]]; then
    log "$name: $(ref "$name") in buildah's storage"
    return 0
  fi
  tmp="$(archive "$1").tmp.$$"
  rm -f "$tmp"
  # zstd: containerd reads it, and it compresses a GB of torch several times faster than gzip.
  buildah_ push --quiet --compression-format zstd "$(ref "$name")" "oci-archive:$tmp:$(ref "$name")" >/dev/null
  mv "$tmp" "$(archive "$name")"
  log "$name: $(ref "$name"), $(du -m "$(archive "$name")" | cut -f1) MB compressed"
}

# cached NAME: an imported image is cached when its archive is there, another one when buildah's storage
# holds it (an imported one that is only there is saved again).
cached() {
  local imported=false
  [[ " $IMPORTED " == *" $1 "* ]] && imported=true
  if [ "$imported" = true ] && [ -f "$(archive "$1")" ]; then
    log "$1: cached $(archive "$1")"
    return 0
  elif buildah_ inspect --type image "$(ref "$1")" >/dev/null 2>&1; then
    log "$1: cached $(ref "$1") in buildah's storage"
    if [ "$imported" = true ]; then save "$1"; fi
    return 0
  fi
  return 1
}

build_base() {
  cached base && return 0
  local started sources container
  started=$(now)
  # The machine's own apt sources (whatever mirror it is configured with) go to mmdebstrap as they are.
  sources=""
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
    if [ -f "$file" ] && grep -qE "^[^#]*\b$SUITE\b" "$file" && grep -qE '^[^#]*debian' "$file"; then
      sources+=" $file"
    fi
  done
  [ -n "$sources" ] || { log "error: no apt source for $SUITE in /etc/apt"; return 1; }
  log "base: mmdebstrap $SUITE with $BASE_PACKAGES from$sources (cold machine: a minute)"
  # shellcheck disable=SC2086 # one word per sources file
  mmdebstrap --quiet --variant=essential --include="$BASE_PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    "$SUITE" "$work/base.tar" $sources >&2
  container=$(buildah_ from scratch)
  buildah_ add --quiet "$container" "$work/base.tar" / >/dev/null
  buildah_ config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env PYTHONUNBUFFERED=1 --cmd '["python3"]' "$container"
  buildah_ commit --quiet --rm "$container" "$(ref base)" >/dev/null
  rm -f "$work/base.tar"
  save base
  log "base: built in $(since "$started")"
}

build_pause() {
  cached pause && return 0
  local started container
  started=$(now)
  build_base
  container=$(buildah_ from --pull=never "$(ref base)")
  buildah_ config --cmd '["/bin/sleep", "infinity"]' --user 65535:65535 "$container"
  buildah_ commit --quiet --rm "$container" "$(ref pause)" >/dev/null
  save pause
  log "pause: built in $(since "$started")"
}

# bud NAME DOCKERFILE CONTEXT ARGS...: buildah bud, FROM images already stored, no registry.
bud() {
  local name=$1 dockerfile=$2 context=$3 started
  shift 3
  started=$(now)
  log "$name: building $dockerfile"
  buildah_ bud --quiet --pull=never --network=host --layers=false -f "$dockerfile" -t "$(ref "$name")" \
    "$@" "$context" >/dev/null
  save "$name"
  log "$name: built in $(since "$started")"
}

# The project's wheel, built from a copy of its sources (a build in the clone would leave build/ behind).
wheel_dir=""
build_wheel() {
  [ -n "$wheel_dir" ] && return 0
  local started src
  started=$(now)
  src="$work/src"
  mkdir -p "$src"
  (cd "$root" && cp -r pyproject.toml README.md operator trainer_sidecar trainguard "$src/")
  find "$src" -name __pycache__ -prune -exec rm -rf {} +
  wheel_dir="$work/dist"
  "$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$wheel_dir" "$src" >&2
  log "wheel: $(basename "$wheel_dir"/trainguard-*.whl) in $(since "$started")"
}

# The wheels the Dockerfiles' pip installs (images/*-requirements.txt, pinned by requirements.lock),
# downloaded here once per key: a build has no index (the machine's reaches PyPI through its own
# configuration). Each bud mounts them with a pip.conf that points at them.
wheels_key=$( (cd "$root" && cat images/trainguard-requirements.txt images/worker-requirements.txt \
  requirements.lock) | hash)
wheelhouse="$cache/wheels/images-$wheels_key"
fetch_wheels() {
  [ -f "$wheelhouse/.complete" ] && return 0
  local started
  started=$(now)
  rm -rf "$wheelhouse"
  mkdir -p "$wheelhouse"
  "$python" -m pip download --quiet --only-binary=:all: --dest "$wheelhouse" \
    -r "$root/images/trainguard-requirements.txt" -r "$root/images/worker-requirements.txt" \
    -c "$root/requirements.lock" >&2
  printf '[global]\nno-index = true\nfind-links = /wheels\n' >"$wheelhouse/pip.conf"
  touch "$wheelhouse/.complete"
  log "wheels: $(find "$wheelhouse" -name '*.whl' | wc -l) downloaded in $(since "$started")"
}
offline_pip=(--volume "$wheelhouse:/wheels:ro" --volume "$wheelhouse/pip.conf:/etc/pip.conf:ro")

# context NAME: a build context with the repository files the Dockerfiles COPY, and dist/ (the wheel).
context() {
  local dir="$work/context-$1"
  mkdir -p "$dir/images" "$dir/dist" "$dir/examples"
  cp "$root/requirements.lock" "$dir/"
  cp "$root"/images/*.txt "$dir/images/"
  cp -r "$root/examples/tiny_lm" "$root/examples/04_fsdp" "$dir/examples/"
  find "$dir" -name __pycache__ -prune -exec rm -rf {} +
  cp "$wheel_dir"/trainguard-*.whl "$dir/dist/"
  echo "$dir"
}

build_trainguard() {
  cached trainguard && return 0
  build_base
  build_wheel
  fetch_wheels
  bud trainguard "$root/images/trainguard.Dockerfile" "$(context trainguard)" --build-arg "BASE=$(ref base)" \
    "${offline_pip[@]}"
}

build_pytorch() {
  cached pytorch && return 0
  build_base
  local dir="$work/context-pytorch"
  mkdir -p "$dir/site-packages"
  torch_closure "$dir/site-packages"
  log "pytorch: $(wc -w <<<"$torch_versions") distributions, $(du -sm "$dir/site-packages" | cut -f1) MB"
  bud pytorch "$root/images/pytorch.Dockerfile" "$dir" --build-arg "BASE=$(ref base)"
}

build_worker() {
  cached worker && return 0
  build_pytorch
  build_wheel
  fetch_wheels
  bud worker "$root/images/worker.Dockerfile" "$(context worker)" --build-arg "PYTORCH_IMAGE=$(ref pytorch)" \
    "${offline_pip[@]}"
}

build_tiny_lm() {
  cached tiny-lm && return 0
  build_worker
  build_wheel
  bud tiny-lm "$root/images/tiny-lm.Dockerfile" "$(context tiny-lm)" --build-arg "WORKER_IMAGE=$(ref worker)"
}

build_coredns() {
  cached coredns && return 0
  local dir="$work/context-coredns"
  [ -x "$coredns_bin" ] || { log "error: no CoreDNS in $coredns_bin: run bash scripts/control-plane.sh"; return 1; }
  mkdir -p "$dir"
  cp "$coredns_bin" "$dir/coredns"
  bud coredns "$root/images/coredns.Dockerfile" "$dir"
}

build_pytorch_init() {
  cached pytorch-init && return 0
  local dir="$work/context-pytorch-init"
  mkdir -p "$dir"
  cp "$BUSYBOX" "$dir/busybox"
  bud pytorch-init "$root/images/pytorch-init.Dockerfile" "$dir"
}

build_base
build_pause
build_trainguard
build_pytorch_init
build_tiny_lm
if [ "$mode" = prebuild ]; then
  log "all images but coredns ready in $(since "$total")"
  exit 0
fi
build_coredns

"$python" - "$manifest" <<PY
import json, sys
images = {$(for n in $IMPORTED; do printf '"%s": {"ref": "%s", "archive": "%s"}, ' "$n" "$(ref "$n")" "$(archive "$n")"; done)}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(images, f, indent=2)
PY
mv "$manifest.tmp" "$manifest"
# Of each image, this build's archive and the newest other one stay (a clone on another commit may
# alternate with this one); older ones go whatever their age: a tiny-lm archive is 2.8 GB, and a machine
# that builds many commits a day filled its disk with them. Manifests (a few hundred bytes) of other
# keys go after two days. (grep finding nothing to drop is not a failure.)
for n in $IMPORTED; do
  find "$out" -maxdepth 1 -name "$n-*.oci.tar" -printf '%T@ %p\n' | sort -rn | cut -d' ' -f2- |
    { grep -vxF "$(archive "$n")" || true; } | tail -n +2 | xargs -r rm -f
done
find "$out" -maxdepth 1 -name 'manifest-*.json' -mtime +2 -print |
  { grep -vxF "$manifest" || true; } | xargs -r rm -f
log "all images ready in $(since "$total")"
if [ "$mode" = push ]; then
  # The images a cluster pulls. skopeo copies the archive's manifest and blobs byte for byte (no new
  # compression), and skips the blobs the registry already holds.
  for name in trainguard tiny-lm; do
    started=$(now)
    skopeo copy --quiet "oci-archive:$(archive "$name")" "docker://$registry/$name:$tag" >&2
    log "$name: pushed $registry/$name:$tag in $(since "$started")"
    echo "$registry/$name:$tag"
  done
  exit 0
fi
echo "$manifest"
