#!/usr/bin/env bash
# Builds (cold) or reuses (warm) the project's virtualenv and links it as ./.venv.
# The environment lives outside the clone, under ~/.cache/trainguard/, keyed by the hash of
# requirements.lock, because PyPI's torch is the multi-gigabyte CUDA build: a warm machine must not
# download it again, and a change of any pinned version must build a fresh environment.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${TRAINGUARD_CACHE:-$HOME/.cache/trainguard}
python=${PYTHON:-python3}
key=$( (cat "$root/requirements.lock"; "$python" --version) | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
mkdir -p "$cache"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  echo "bootstrap: building $venv (cold machine: downloads torch, a few minutes)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --cache-dir "$cache/pip" -r "$root/requirements.lock"
  touch "$venv/.complete"
else
  echo "bootstrap: reusing $venv" >&2
fi
# The project itself is installed editable on every run: cheap, and it must point at this clone.
"$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e "$root"
ln -sfn "$venv" "$root/.venv"
mkdir -p "$root/build/mypy"
ln -sfn ../../operator "$root/build/mypy/trainguard_operator"
