#!/usr/bin/env bash
# Builds (cold) or reuses (warm) a real Kubernetes cluster for the end-to-end tests, and runs it by hand.
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the Kubeflow training operator, and the
# node's kubelet, kube-proxy and CoreDNS are built from the Go module proxy with the machine's Go, outside
# the clone, under ~/.cache/trainguard/ (or $TRAINGUARD_CACHE); the node's container runtime and network
# (containerd, runc, the CNI plugins, iptables, conntrack) are Debian's packages, installed when missing,
# and so is a container registry for the install test (Debian's docker-registry, its binary only):
#
#   bin/<component>-<version>/<component>   one directory per component and version: a version bump
#                                            builds afresh, an unchanged one is reused as is
#   bin/control-plane-<key>/<component>     symlinks to the above; <key> hashes the versions
#   kubeflow/training-operator-<version>/    the PyTorchJob CRD and Kubeflow's simple PyTorchJob example,
#                                            copied from the module the training operator is built from
#   go/{mod,build,path}                      GOMODCACHE, GOCACHE, GOPATH (shared with scripts/tools.sh)
#
# Versions. The preinstalled kubectl is 1.32 (Google Cloud CLI's dispatcher, which also ships kubectl
# 1.27..1.33 and runs the one matching the server's minor), and kubectl supports a server one minor away
# at most, so Kubernetes 1.30 (the newest Debian 12's etcd 3.4.23 can serve) is out. Of 1.31..1.33, the
# Go module proxy reached here publishes every staging module that the API server, controller manager
# and scheduler need at the matching version only for 1.33 (1.32.13 lacks k8s.io/endpointslice,
# 1.31.14 more), so the control plane is Kubernetes 1.33, at its newest patch. Kubernetes 1.31 and later
# need etcd >= 3.4.29 / 3.5.11, so etcd is built too, from the 3.5 series Kubernetes 1.33 is tested
# against, at its newest patch. The kubelet and kube-proxy are the API server's release (the kubelet may not
# be newer than the API server); CoreDNS is the newest release, which has no replace directives and so
# installs with a plain `go install`.
#
# etcd's and Kubernetes' modules carry replace directives (k8s.io/kubernetes for its staging modules, etcd's server for its
# sibling modules), which `go install pkg@version` refuses. So each is built as a dependency of a small
# wrapper module made in a temp dir outside the clone, requiring the module and its siblings at the
# matching published versions.
#
# Usage:
#   bash scripts/control-plane.sh [build]       build what is missing; print the bin directory on stdout
#   bash scripts/control-plane.sh --bin-dir     print the bin directory only (builds nothing)
#   bash scripts/control-plane.sh kubeflow      fetch Kubeflow's manifests only (seconds); print their dir
#   bash scripts/control-plane.sh --kubeflow-dir  print that directory only (fetches nothing)
#   bash scripts/control-plane.sh start [DIR]   build if needed (and the images, scripts/images.sh, and
#                                               helm, scripts/tools.sh), then run the whole test cluster
#                                               (tests/support/cluster.py: the control plane on free
#                                               127.0.0.1 ports, a real node, the trainguard operator
#                                               installed by its Helm chart; state in DIR, default a temp
#                                               dir) until Ctrl-C; needs root; prints
#                                               the kubeconfig path, e.g.
#                                               export KUBECONFIG=<that path>; kubectl get gtj
#
# Everything but the final path goes to stderr, with the time each phase took. Idempotent, and safe to
# run concurrently (a lock serialises the builds).
set -euo pipefail

KUBERNETES_VERSION=v1.33.13
# Kubernetes publishes its staging modules (k8s.io/api, ...) as v0.MM.P for release v1.MM.P.
STAGING_VERSION=v0.${KUBERNETES_VERSION#v1.}
ETCD_VERSION=v3.5.35
# etcd's client/v2 module is versioned v2.305.P for etcd v3.5.P.
ETCD_CLIENT_V2_VERSION=v2.305.${ETCD_VERSION##*.}
# The Kubeflow training operator v1 (PyTorchJob), at the newest v1.9 patch. Its module holds the CRD the
# tests install and validate renders against (fetch_kubeflow_manifests).
TRAINING_OPERATOR_VERSION=v1.9.3
COREDNS_VERSION=v1.15.0
# The plugins the test node's Corefile uses (tests/support/node.py), in CoreDNS's order (build_coredns).
COREDNS_PLUGINS="bind ready health errors cache kubernetes"

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${TRAINGUARD_CACHE:-$HOME/.cache/trainguard}
key=$(printf 'kubernetes %s\netcd %s\ntraining-operator %s\ncoredns %s %s\n' "$KUBERNETES_VERSION" "$ETCD_VERSION" \
  "$TRAINING_OPERATOR_VERSION" "$COREDNS_VERSION" "$COREDNS_PLUGINS" | sha256sum | cut -c1-12)
bin_dir="$cache/bin/control-plane-$key"
kubeflow_dir="$cache/kubeflow/training-operator-$TRAINING_OPERATOR_VERSION"

mode=${1:-build}
case "$mode" in
  --bin-dir)
    echo "$bin_dir"
    exit 0
    ;;
  --kubeflow-dir)
    echo "$kubeflow_dir"
    exit 0
    ;;
  build | start | kubeflow) ;;
  *)
    echo "usage: bash scripts/control-plane.sh [build | kubeflow | --bin-dir | --kubeflow-dir | start [DIR]]" >&2
    exit 2
    ;;
esac

log() { printf 'control-plane: %s\n' "$*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
# apt-get, one at a time among this repository's scripts (.ci/run runs them side by side): apt's own
# locks make a second apt-get fail rather than wait.
apt_locked() {
  mkdir -p "$cache"
  if command -v flock >/dev/null; then flock "$cache/.apt.lock" "$@"; else "$@"; fi
}

command -v go >/dev/null || {
  log "error: go is not on PATH (the control plane is built from the Go module proxy)"
  exit 1
}

export GOPATH="$cache/go/path"
export GOMODCACHE="$cache/go/mod"
export GOCACHE="$cache/go/build"
export GOTOOLCHAIN=local # build with the machine's Go; never fetch another toolchain silently
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0 # static binaries, as Kubernetes releases them; no C toolchain needed
mkdir -p "$cache/bin" "$GOPATH" "$GOMODCACHE" "$GOCACHE"

total=$(now)

# Kubeflow's manifests the tests use, taken from the training operator's own module at the version built
# below (the Go module proxy serves a module's whole tree): the PyTorchJob CRD (installed on the test
# cluster, and the schema every rendered PyTorchJob is checked against) and the simple PyTorchJob example
# (the admission test creates it). The module cache is read-only, so the files are copied out, into a
# temp dir renamed into place: a fetch interrupted or run twice at once leaves a whole directory or none.
fetch_kubeflow_manifests() {
  local module_dir tmp started
  if [ -f "$kubeflow_dir/kubeflow.org_pytorchjobs.yaml" ] && [ -f "$kubeflow_dir/pytorchjob-simple.yaml" ]; then
    log "kubeflow manifests $TRAINING_OPERATOR_VERSION: cached in $kubeflow_dir"
    return 0
  fi
  started=$(now)
  module_dir=$(cd "${TMPDIR:-/tmp}" &&
    go mod download -json "github.com/kubeflow/training-operator@$TRAINING_OPERATOR_VERSION" |
    sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  if [ -z "$module_dir" ] || [ ! -f "$module_dir/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" ]; then
    log "error: github.com/kubeflow/training-operator@$TRAINING_OPERATOR_VERSION has no PyTorchJob CRD" \
      "(manifests/base/crds/kubeflow.org_pytorchjobs.yaml) in the module cache"
    return 1
  fi
  mkdir -p "$(dirname "$kubeflow_dir")"
  tmp=$(mktemp -d "$kubeflow_dir.XXXXXX")
  cp "$module_dir/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" "$tmp/kubeflow.org_pytorchjobs.yaml"
  cp "$module_dir/examples/pytorch/simple.yaml" "$tmp/pytorchjob-simple.yaml"
  chmod 755 "$tmp"
  chmod 644 "$tmp"/*.yaml
  rm -rf "$kubeflow_dir"
  mv -T "$tmp" "$kubeflow_dir" 2>/dev/null || rm -rf "$tmp" # another fetch won the race: keep its copy
  log "kubeflow manifests $TRAINING_OPERATOR_VERSION: fetched in $(since "$started") into $kubeflow_dir"
}
fetch_kubeflow_manifests
if [ "$mode" = kubeflow ]; then
  echo "$kubeflow_dir"
  exit 0
fi

# One builder at a time (a developer's shell and CI may start together); the loser then finds the
# binaries built and reuses them.
exec 9>"$cache/bin/.control-plane.lock"
if command -v flock >/dev/null; then
  flock 9
fi

work=""
cleanup() { if [ -n "$work" ]; then rm -rf "$work"; fi; }
trap cleanup EXIT

# wrapper NAME GO_DIRECTIVE REQUIRE_LINES: a fresh wrapper module in a temp dir; sets $work.
wrapper() {
  local name=$1 go_directive=$2 requires=$3
  cleanup
  work=$(mktemp -d "${TMPDIR:-/tmp}/trainguard-build-$name.XXXXXX")
  printf 'module trainguard.invalid/build/%s\n\n%s\n\nrequire (\n%s)\n' \
    "$name" "$go_directive" "$requires" >"$work/go.mod"
}

# build NAME VERSION PACKAGE MODULE_VERSION LDFLAGS: resolve + download PACKAGE@MODULE_VERSION (an
# explicit version: a bare `go get` would upgrade), then compile it in the current wrapper module,
# into a temp dir, then an atomic rename into bin/NAME-VERSION/, so an interrupted build leaves nothing
# half-made behind.
build() {
  local name=$1 version=$2 package=$3 module_version=$4 ldflags=$5
  local dir="$cache/bin/$name-$version" started tmp
  started=$(now)
  log "$name $version: resolving and downloading $package (cold machine: a minute or two)"
  if ! (cd "$work" && go get "$package@$module_version") >"$work/get.log" 2>&1; then
    cat "$work/get.log" >&2
    log "error: resolving $package@$module_version failed (see above)"
    return 1
  fi
  log "$name $version: modules ready in $(since "$started")" \
    "($(grep -c '^go: downloading' "$work/get.log" || true) downloaded)"
  started=$(now)
  log "$name $version: compiling (cold machine: several minutes)"
  tmp=$(mktemp -d "$cache/bin/.$name-$version.XXXXXX")
  chmod 755 "$tmp"
  if ! (cd "$work" && go build -trimpath -ldflags "-s -w $ldflags" -o "$tmp/$name" "$package"); then
    rm -rf "$tmp"
    log "error: building $name $version failed (see above)"
    return 1
  fi
  rm -rf "$dir"
  mv "$tmp" "$dir"
  log "$name $version: compiled in $(since "$started")"
}

build_etcd() {
  if [ -x "$cache/bin/etcd-$ETCD_VERSION/etcd" ]; then
    log "etcd $ETCD_VERSION: cached in $cache/bin/etcd-$ETCD_VERSION"
    return 0
  fi
  local requires=""
  requires+="	go.etcd.io/etcd/server/v3 $ETCD_VERSION"$'\n'
  requires+="	go.etcd.io/etcd/api/v3 $ETCD_VERSION"$'\n'
  requires+="	go.etcd.io/etcd/client/pkg/v3 $ETCD_VERSION"$'\n'
  requires+="	go.etcd.io/etcd/client/v2 $ETCD_CLIENT_V2_VERSION"$'\n'
  requires+="	go.etcd.io/etcd/client/v3 $ETCD_VERSION"$'\n'
  requires+="	go.etcd.io/etcd/pkg/v3 $ETCD_VERSION"$'\n'
  requires+="	go.etcd.io/etcd/raft/v3 $ETCD_VERSION"$'\n'
  # The wrapper's go line must not be older than the server module's.
  local go_line
  go_line=$(cd "${TMPDIR:-/tmp}" && go mod download -json "go.etcd.io/etcd/server/v3@$ETCD_VERSION" |
    sed -n 's/.*"GoMod": "\(.*\)".*/\1/p' | xargs grep -m1 '^go ')
  wrapper etcd "$go_line" "$requires"
  # The server module's main package is its root (server/main.go); GitSHA shows in `etcd --version`.
  build etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" \
    "-X go.etcd.io/etcd/api/v3/version.GitSHA=module-$ETCD_VERSION"
}

# kubernetes_gomod: the path of k8s.io/kubernetes's go.mod at the pinned release (downloads only it).
kubernetes_gomod() {
  (cd "${TMPDIR:-/tmp}" && go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION") |
    sed -n 's/.*"GoMod": "\(.*\)".*/\1/p'
}

# The staging modules k8s.io/kubernetes replaces with ./staging/src/..., read from its own go.mod, so a
# version bump needs no list edited here.
staging_modules() {
  sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/src/.*#\1#p' "$1"
}

kube_ldflags() {
  local minor=${KUBERNETES_VERSION#v1.}
  minor=${minor%%.*}
  local pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    printf -- '-X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean ' \
      "$pkg" "$KUBERNETES_VERSION" "$pkg" "$pkg" "$minor" "$pkg"
  done
}

# build_kube COMPONENT: cmd/COMPONENT of k8s.io/kubernetes at the pinned release.
build_kube() {
  local name=$1
  if [ -x "$cache/bin/$name-$KUBERNETES_VERSION/$name" ]; then
    log "$name $KUBERNETES_VERSION: cached in $cache/bin/$name-$KUBERNETES_VERSION"
    return 0
  fi
  local started gomod requires module n=0 unpublished=""
  started=$(now)
  gomod=$(kubernetes_gomod)
  requires="	k8s.io/kubernetes $KUBERNETES_VERSION"$'\n'
  for module in $(staging_modules "$gomod"); do
    # Each staging module at the matching version. The proxy reached here lacks a few that no command
    # imports (k8s.io/sample-apiserver, sample-controller, sample-cli-plugin): those stay unrequired,
    # and a build that did need one would fail with "no required module provides package".
    if (cd "${TMPDIR:-/tmp}" && go list -m "$module@$STAGING_VERSION") >/dev/null 2>&1; then
      requires+="	$module $STAGING_VERSION"$'\n'
      n=$((n + 1))
    else
      unpublished+=" $module"
    fi
  done
  for module in k8s.io/api k8s.io/apimachinery k8s.io/apiserver k8s.io/client-go k8s.io/component-base; do
    if [[ " $unpublished " == *" $module "* ]]; then
      log "error: $module $STAGING_VERSION is not available from the Go module proxy"
      return 1
    fi
  done
  log "$name $KUBERNETES_VERSION: $n staging modules required at $STAGING_VERSION" \
    "(not published, not needed:${unpublished:- none}) ($(since "$started"))"
  # The wrapper, as the main module, decides the language version and the GODEBUG defaults: it keeps
  # the release's (`go 1.24.0`, `godebug default=go1.24` for 1.33).
  wrapper "$name" "$(grep -E '^(go|godebug) ' "$gomod")" "$requires"
  build "$name" "$KUBERNETES_VERSION" "k8s.io/kubernetes/cmd/$name" "$KUBERNETES_VERSION" "$(kube_ldflags)"
}

# go_install NAME VERSION PACKAGE@VERSION BINARY LDFLAGS: for modules without replace directives (the training
# operator, CoreDNS), a plain `go install` into a temp GOBIN, then an atomic rename, as build() does.
go_install() {
  local name=$1 version=$2 target=$3 binary=$4 ldflags=$5
  local dir="$cache/bin/$name-$version" started tmp
  if [ -x "$dir/$name" ]; then
    log "$name $version: cached in $dir"
    return 0
  fi
  started=$(now)
  log "$name $version: go install $target (cold machine: several minutes)"
  tmp=$(mktemp -d "$cache/bin/.$name-$version.XXXXXX")
  chmod 755 "$tmp"
  if ! (cd "${TMPDIR:-/tmp}" && GOBIN="$tmp" go install -trimpath -ldflags "-s -w $ldflags" "$target"); then
    rm -rf "$tmp"
    log "error: building $name $version failed (see above)"
    return 1
  fi
  if [ "$binary" != "$name" ]; then mv "$tmp/$binary" "$tmp/$name"; fi
  rm -rf "$dir"
  mv "$tmp" "$dir"
  log "$name $version: built in $(since "$started")"
}

build_training_operator() {
  go_install training-operator "$TRAINING_OPERATOR_VERSION" \
    "github.com/kubeflow/training-operator/cmd/training-operator.v1@$TRAINING_OPERATOR_VERSION" \
    training-operator.v1 ""
}

# CoreDNS with only the plugins the test node's Corefile uses (tests/support/node.py), listed in CoreDNS's
# own order (its plugin.cfg), which is the order a query passes them. CoreDNS's main package imports every
# plugin (core/plugin); a small main that imports coremain and these plugins, and sets the directives,
# builds the same server with the plugins named here only, in about a third of the time (measured
# 6.5 min instead of about 16 on 2 cores, cold). The version is compiled in (coremain.CoreVersion), the
# commit is stamped as the module version.
build_coredns() {
  local key dir started tmp directives="" plugin
  key=$(printf '%s\n' "$COREDNS_PLUGINS" | sha256sum | cut -c1-8)
  coredns_dir="coredns-$COREDNS_VERSION-$key"
  dir="$cache/bin/$coredns_dir"
  if [ -x "$dir/coredns" ]; then
    log "coredns $COREDNS_VERSION: cached in $dir (plugins: $COREDNS_PLUGINS)"
    return 0
  fi
  started=$(now)
  log "coredns $COREDNS_VERSION: resolving and downloading (cold machine: a minute or two)"
  wrapper coredns "" "	github.com/coredns/coredns $COREDNS_VERSION"$'\n'
  {
    printf 'package main\n\nimport (\n\t"github.com/coredns/coredns/core/dnsserver"\n'
    printf '\t"github.com/coredns/coredns/coremain"\n'
    for plugin in $COREDNS_PLUGINS; do
      printf '\t_ "github.com/coredns/coredns/plugin/%s"\n' "$plugin"
      directives+="\"$plugin\", "
    done
    printf ')\n\nfunc init() { dnsserver.Directives = []string{%s} }\n\n' "${directives%, }"
    printf 'func main() { coremain.Run() }\n'
  } >"$work/main.go"
  if ! (cd "$work" && go mod tidy) >"$work/get.log" 2>&1; then
    cat "$work/get.log" >&2
    log "error: resolving CoreDNS $COREDNS_VERSION failed (see above)"
    return 1
  fi
  log "coredns $COREDNS_VERSION: modules ready in $(since "$started"); compiling (cold machine: several minutes)"
  tmp=$(mktemp -d "$cache/bin/.$coredns_dir.XXXXXX")
  chmod 755 "$tmp"
  if ! (cd "$work" && go build -trimpath -ldflags \
    "-s -w -X github.com/coredns/coredns/coremain.GitCommit=module-$COREDNS_VERSION" -o "$tmp/coredns" .); then
    rm -rf "$tmp"
    log "error: building CoreDNS $COREDNS_VERSION failed (see above)"
    return 1
  fi
  rm -rf "$dir"
  mv "$tmp" "$dir"
  log "coredns $COREDNS_VERSION: built in $(since "$started") (plugins: $COREDNS_PLUGINS)"
}

# kubectl must be within one minor of the server. The image's kubectl (1.32, which dispatches to the
# server's minor) is used when it fits; otherwise the same release's kubectl is built as well.
kubectl_fits() {
  local minor want=${KUBERNETES_VERSION#v1.}
  want=${want%%.*}
  command -v kubectl >/dev/null || return 1
  minor=$(kubectl version --client -o json 2>/dev/null | sed -n 's/.*"minor": "\([0-9]*\).*/\1/p' | head -n1)
  [ -n "$minor" ] && [ "$minor" -ge $((want - 1)) ] && [ "$minor" -le $((want + 1)) ]
}

# Debian packages the tests need: openssl (tests/support/controlplane.py makes the certificates), and the
# test node's runtime and network (tests/support/node.py): containerd (its CRI plugin serves the kubelet),
# runc, containernetworking-plugins (bridge, host-local, loopback in /usr/lib/cni), iptables and conntrack
# (kube-proxy), iproute2 (the node's bridge, address and routes). Only openssl is required: the node runs
# as root anyway, so elsewhere its tests are skipped (and fail under CI).
missing_packages="" required_missing=""
for entry in openssl:openssl:required ip:iproute2 \
  containerd:containerd ctr:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins \
  iptables:iptables conntrack:conntrack; do
  IFS=: read -r tool package need <<<"$entry"
  if ! command -v "$tool" >/dev/null; then
    missing_packages+=" $package"
    if [ "$need" = required ]; then required_missing+=" $package"; fi
  fi
done
if [ -n "$missing_packages" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    started=$(now)
    log "installing Debian's packages:$missing_packages"
    # shellcheck disable=SC2086 # one word per package
    apt_locked apt-get update -qq >&2 && apt_locked apt-get install -y -qq --no-install-recommends $missing_packages >&2
    log "installed in $(since "$started")"
  elif [ -n "$required_missing" ]; then
    log "error: missing Debian packages:$required_missing (apt-get install them, as root)"
    exit 1
  else
    log "warning: missing Debian packages:$missing_packages: the test node's tests will be skipped"
  fi
fi

# A container registry for the install test (tests/e2e/test_install_readme.py pushes the README's images to
# it and the node pulls them from it): Debian's docker-registry (the CNCF distribution registry), only its
# binary, taken out of the package into the cache, because installing the package would start its
# service. Kept once fetched, whatever Debian's version is later.
get_registry() {
  local found deb started dir version
  found=$(find "$cache/bin" -maxdepth 2 -path '*/registry-*/registry' -type f 2>/dev/null | sort | tail -n1)
  if [ -n "$found" ]; then
    log "registry: cached in $(dirname "$found")"
    registry_dir=$(basename "$(dirname "$found")")
    return 0
  fi
  started=$(now)
  cleanup
  work=$(mktemp -d "${TMPDIR:-/tmp}/trainguard-registry.XXXXXX")
  # _apt cannot write to a root-owned temp dir: download as root (apt warns, and does it).
  if ! (cd "$work" && apt_locked apt-get download docker-registry >/dev/null 2>&1); then
    apt_locked apt-get update -qq >&2
    (cd "$work" && apt_locked apt-get download docker-registry >/dev/null 2>&1) || {
      log "warning: apt-get download docker-registry failed: the install test will fail"
      return 0
    }
  fi
  deb=$(echo "$work"/docker-registry_*.deb)
  version=$(dpkg-deb --field "$deb" Version)
  dpkg-deb --extract "$deb" "$work/root"
  dir="$cache/bin/registry-${version//[^A-Za-z0-9.+-]/_}"
  mkdir -p "$dir.tmp"
  mv "$work/root/usr/bin/docker-registry" "$dir.tmp/registry"
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
  registry_dir=$(basename "$dir")
  log "registry: Debian's docker-registry $version in $(since "$started")"
}

build_etcd
build_kube kube-apiserver
build_kube kube-controller-manager
build_kube kube-scheduler
build_training_operator
build_kube kubelet
build_kube kube-proxy
coredns_dir=""
build_coredns
registry_dir=""
get_registry
build_kubectl=false
if [ "${TRAINGUARD_BUILD_KUBECTL:-}" = 1 ] || ! kubectl_fits; then
  build_kubectl=true
  build_kube kubectl
fi
cleanup
work=""

started=$(now)
mkdir -p "$bin_dir"
ln -sfn "../etcd-$ETCD_VERSION/etcd" "$bin_dir/etcd"
for component in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
  ln -sfn "../$component-$KUBERNETES_VERSION/$component" "$bin_dir/$component"
done
ln -sfn "../training-operator-$TRAINING_OPERATOR_VERSION/training-operator" "$bin_dir/training-operator"
ln -sfn "../$coredns_dir/coredns" "$bin_dir/coredns"
if [ -n "$registry_dir" ]; then ln -sfn "../$registry_dir/registry" "$bin_dir/registry"; fi
if [ "$build_kubectl" = true ]; then
  ln -sfn "../kubectl-$KUBERNETES_VERSION/kubectl" "$bin_dir/kubectl"
else
  rm -f "$bin_dir/kubectl"
  log "kubectl: using $(command -v kubectl) ($(kubectl version --client 2>/dev/null | head -n1))"
fi
log "etcd: $("$bin_dir/etcd" --version 2>&1 | head -n1)"
for component in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
  log "$component: $("$bin_dir/$component" --version 2>&1)"
done
log "training-operator: $TRAINING_OPERATOR_VERSION"
log "coredns: $("$bin_dir/coredns" -version 2>&1 | head -n1)"
log "linked in $(since "$started"); control plane binaries ready in $(since "$total")"

if [ "$mode" = start ]; then
  exec 9>&- # release the build lock while the control plane runs
  bash "$root/scripts/images.sh" >/dev/null
  bash "$root/scripts/tools.sh" >/dev/null # helm: the operator is installed with its chart
  python=${PYTHON:-$root/.venv/bin/python}
  cd "$root" && exec "$python" -m tests.support.cluster --bin-dir "$bin_dir" ${2:+--state-dir "$2"}
fi
echo "$bin_dir"
