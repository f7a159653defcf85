#!/usr/bin/env bash
# Everything the test suite needs, built or reused from ~/.cache/trainguard (a cold machine builds once,
# a warm one takes seconds): the Python environment (./.venv), helm, promtool, prometheus and
# monitoring-check (scripts/tools.sh), and etcd + kube-apiserver (scripts/control-plane.sh).
# The tests find the tools by themselves; .ci/run runs the same three steps as separate phases.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
bash "$root/scripts/tools.sh" >/dev/null
bash "$root/scripts/control-plane.sh" >/dev/null
