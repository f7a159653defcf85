#!/usr/bin/env bash
# Builds (cold) or reuses (warm) the Go tools the chart and alert tests run: helm, promtool, the
# Prometheus server, and monitoring-check (a strict decoder of ServiceMonitor, PodMonitor and
# PrometheusRule objects into the Prometheus Operator's own Go API types). They are built from the Go
# module proxy with the machine's Go, outside the clone, under ~/.cache/trainguard/ (or
# $TRAINGUARD_CACHE):
#
#   bin/<tool>-<version>/<tool>     one directory per tool and version: a version bump builds afresh,
#                                   an unchanged one is reused as is (monitoring-check's version also
#                                   carries a hash of its source, promtool's and prometheus's their
#                                   build tags, below)
#   bin/tools-<key>/<tool>          symlinks to the four above; <key> hashes their versions
#   go/{mod,build,path}             GOMODCACHE, GOCACHE, GOPATH: a rebuild reuses downloads and objects
#
# Usage:
#   bash scripts/tools.sh               build what is missing; print the tools directory on stdout
#   bash scripts/tools.sh --bin-dir     print the tools directory only (builds nothing; tests use it)
#
# Everything but the final directory goes to stderr, with the time each phase took, so a caller can do
#   export TRAINGUARD_BIN=$(bash scripts/tools.sh) PATH="$TRAINGUARD_BIN:$PATH"
# Idempotent, and safe to run concurrently (a lock serialises the builds).
set -euo pipefail

# helm v3: the chart's apiVersion v2 and `helm lint` / `helm template` as users run them.
HELM_VERSION=v3.22.0
# Prometheus publishes its Go module as v0.3MM.P for release v3.MM.P: v0.316.0 is Prometheus v3.16.0.
PROMETHEUS_MODULE_VERSION=v0.316.0
PROMETHEUS_VERSION=3.16.0
# The Prometheus Operator's API types (their own Go module), for monitoring-check.
MONITORING_API_VERSION=v0.95.2
# promtool and the Prometheus server without the service discoveries of clouds and orchestrators
# (Prometheus's own build tag: only file and HTTP discovery, and static targets, remain). The tests
# scrape static targets only, and the cloud SDKs (AWS, Azure, GCE, Kubernetes, ...) were most of the
# cold build: promtool alone took about 30 min on 2 cores with them.
PROMETHEUS_TAGS=remove_all_sd

cache=${TRAINGUARD_CACHE:-$HOME/.cache/trainguard}
# monitoring-check's source: a tiny program whose module requires the Prometheus Operator's API module.
read -r -d '' MONITORING_CHECK_SOURCE <<'GO' || true
// monitoring-check strictly decodes Prometheus Operator objects (ServiceMonitor, PodMonitor,
// PrometheusRule), one JSON document per file, into the Prometheus Operator's own Go API types:
// an unknown field, a wrong type or an unknown kind is an error. Exit 0 when every file is valid.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
)

func decode(data []byte) (string, error) {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := json.Unmarshal(data, &head); err != nil {
		return "", err
	}
	if head.APIVersion != "monitoring.coreos.com/v1" {
		return "", fmt.Errorf("apiVersion %q is not monitoring.coreos.com/v1", head.APIVersion)
	}
	var obj any
	switch head.Kind {
	case "ServiceMonitor":
		obj = &monitoringv1.ServiceMonitor{}
	case "PodMonitor":
		obj = &monitoringv1.PodMonitor{}
	case "PrometheusRule":
		obj = &monitoringv1.PrometheusRule{}
	default:
		return "", fmt.Errorf("unsupported kind %q", head.Kind)
	}
	decoder := json.NewDecoder(bytes.NewReader(data))
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(obj); err != nil {
		return "", fmt.Errorf("%s: %w", head.Kind, err)
	}
	return head.Kind, nil
}

func main() {
	failed := false
	for _, path := range os.Args[1:] {
		data, err := os.ReadFile(path)
		if err == nil {
			var kind string
			if kind, err = decode(data); err == nil {
				fmt.Printf("ok %s %s\n", kind, path)
				continue
			}
		}
		fmt.Fprintf(os.Stderr, "invalid %s: %v\n", path, err)
		failed = true
	}
	if failed {
		os.Exit(1)
	}
}
GO
monitoring_check_version="$MONITORING_API_VERSION-$(printf '%s' "$MONITORING_CHECK_SOURCE" | sha256sum | cut -c1-8)"
prometheus_build="$PROMETHEUS_MODULE_VERSION-$PROMETHEUS_TAGS"
key=$(printf 'helm %s\nprometheus %s\nmonitoring-check %s\n' "$HELM_VERSION" "$prometheus_build" \
  "$monitoring_check_version" | sha256sum | cut -c1-12)
bin_dir="$cache/bin/tools-$key"

if [ "${1:-}" = "--bin-dir" ]; then
  echo "$bin_dir"
  exit 0
elif [ $# -gt 0 ]; then
  echo "usage: bash scripts/tools.sh [--bin-dir]" >&2
  exit 2
fi

log() { printf 'tools: %s\n' "$*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }

command -v go >/dev/null || { log "error: go is not on PATH (the tools are built from the Go module proxy)"; exit 1; }

export GOPATH="$cache/go/path"
export GOMODCACHE="$cache/go/mod"
export GOCACHE="$cache/go/build"
export GOTOOLCHAIN=local # build with the machine's Go; never fetch another toolchain silently
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0 # static binaries; no C toolchain needed
mkdir -p "$cache/bin" "$GOPATH" "$GOMODCACHE" "$GOCACHE"

# One builder at a time (a developer's shell and CI may start together); the loser then finds the
# binaries built and reuses them.
exec 9>"$cache/bin/.tools.lock"
if command -v flock >/dev/null; then
  flock 9
fi

total=$(now)

# build NAME VERSION PACKAGE@MODULE_VERSION LDFLAGS_FUNCTION [TAGS]: go install into a temp dir, then an
# atomic rename into bin/NAME-VERSION/, so an interrupted build leaves nothing half-made behind.
build() {
  local name=$1 version=$2 target=$3 ldflags_function=$4 tags=${5:-}
  local dir="$cache/bin/$name-$version"
  if [ -x "$dir/$name" ]; then
    log "$name $version: cached in $dir"
    return 0
  fi
  local started tmp ldflags
  started=$(now)
  ldflags=$("$ldflags_function")
  tmp=$(mktemp -d "$cache/bin/.$name-$version.XXXXXX")
  log "$name $version: building $target (cold machine: a few minutes)"
  if ! GOBIN="$tmp" go install -trimpath -tags "$tags" -ldflags "-s -w $ldflags" "$target"; then
    rm -rf "$tmp"
    log "error: building $name $version failed (see above)"
    return 1
  fi
  rm -rf "$dir"
  mv "$tmp" "$dir"
  log "$name $version: built in $(since "$started")"
}

prom_ldflags() {
  local v=github.com/prometheus/common/version
  printf -- '-X %s.Version=%s -X %s.Branch=module -X %s.Revision=%s' \
    "$v" "$PROMETHEUS_VERSION" "$v" "$v" "$PROMETHEUS_MODULE_VERSION"
}

# helm's own Makefile stamps its version and the Kubernetes version its client libraries speak (the
# default of `helm template`'s .Capabilities.KubeVersion and lint's deprecation checks): do the same.
helm_ldflags() {
  local gomod k8s minor
  gomod=$(go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
  k8s=$(awk '$1 == "k8s.io/client-go" { print $2; exit }' "$gomod") # v0.MINOR.PATCH
  minor=$(echo "$k8s" | cut -d. -f2)
  [ -n "$minor" ] || { log "error: no k8s.io/client-go version in $gomod"; return 1; }
  local v=helm.sh/helm/v3
  printf -- '-X %s/internal/version.version=%s -X %s/internal/version.gitTreeState=clean' "$v" "$HELM_VERSION" "$v"
  printf -- ' -X %s/pkg/chartutil.k8sVersionMajor=1 -X %s/pkg/chartutil.k8sVersionMinor=%s' "$v" "$v" "$minor"
  printf -- ' -X %s/pkg/lint/rules.k8sVersionMajor=1 -X %s/pkg/lint/rules.k8sVersionMinor=%s' "$v" "$v" "$minor"
}

build helm "$HELM_VERSION" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" helm_ldflags
build promtool "$prometheus_build" \
  "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_MODULE_VERSION" prom_ldflags "$PROMETHEUS_TAGS"
build prometheus "$prometheus_build" \
  "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_MODULE_VERSION" prom_ldflags "$PROMETHEUS_TAGS"

# monitoring-check is built in a temporary wrapper module (go install cannot build a package that
# does not exist yet); the module cache and build cache make a rebuild cheap.
build_monitoring_check() {
  local dir="$cache/bin/monitoring-check-$monitoring_check_version"
  if [ -x "$dir/monitoring-check" ]; then
    log "monitoring-check $monitoring_check_version: cached in $dir"
    return 0
  fi
  local started work
  started=$(now)
  work=$(mktemp -d "$cache/bin/.monitoring-check.XXXXXX")
  log "monitoring-check $monitoring_check_version: building against" \
    "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring@$MONITORING_API_VERSION"
  printf '%s\n' "$MONITORING_CHECK_SOURCE" >"$work/main.go"
  printf 'module trainguard.local/monitoring-check\n\ngo 1.26\n' >"$work/go.mod"
  if ! (cd "$work" &&
    go get "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring@$MONITORING_API_VERSION" &&
    go build -trimpath -ldflags "-s -w" -o "$work/out/monitoring-check" .); then
    rm -rf "$work"
    log "error: building monitoring-check failed (see above)"
    return 1
  fi
  rm -rf "$dir"
  mv "$work/out" "$dir"
  rm -rf "$work"
  log "monitoring-check $monitoring_check_version: built in $(since "$started")"
}
build_monitoring_check

started=$(now)
mkdir -p "$bin_dir"
ln -sfn "../helm-$HELM_VERSION/helm" "$bin_dir/helm"
ln -sfn "../promtool-$prometheus_build/promtool" "$bin_dir/promtool"
ln -sfn "../prometheus-$prometheus_build/prometheus" "$bin_dir/prometheus"
ln -sfn "../monitoring-check-$monitoring_check_version/monitoring-check" "$bin_dir/monitoring-check"
log "helm: $("$bin_dir/helm" version --short 2>&1)"
log "promtool: $("$bin_dir/promtool" --version 2>&1 | head -n1)"
log "prometheus: $("$bin_dir/prometheus" --version 2>&1 | head -n1)"
log "linked in $(since "$started"); all tools ready in $(since "$total")"
echo "$bin_dir"
