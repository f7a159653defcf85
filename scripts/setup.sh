#!/usr/bin/env bash
# Everything the test suite needs, built or reused from ~/.cache/trainguard (a cold machine builds once,
# a warm one takes seconds): the Python environment (./.venv), helm, promtool, prometheus and
# monitoring-check (scripts/tools.sh), the cluster's binaries (scripts/control-plane.sh), Kubeflow
# Trainer v2 and JobSet (scripts/trainer.sh) and the test
# node's images (scripts/images.sh, as root). The tests find them by themselves; .ci/run runs the same
# steps as separate phases.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
bash "$root/scripts/tools.sh" >/dev/null
bash "$root/scripts/control-plane.sh" >/dev/null
bash "$root/scripts/trainer.sh" >/dev/null
bash "$root/scripts/images.sh" >/dev/null # after control-plane.sh: the CoreDNS image takes its binary
