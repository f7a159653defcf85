#!/usr/bin/env bash
# Builds (cold) or reuses (warm) the project's Python environment and makes ./.venv.
#
# Two layers, because PyPI's torch is the multi-gigabyte CUDA build:
# - the dependencies live outside the clone, in ~/.cache/trainguard/deps-<hash of requirements.lock>,
#   built once per lock file and shared by every clone on the machine;
# - ./.venv is a thin virtualenv of this clone: it sees the shared dependencies through a .pth file
#   and holds only this clone's editable install, so two clones never import each other's code.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${TRAINGUARD_CACHE:-$HOME/.cache/trainguard}
python=${PYTHON:-python3}
key=$( (cat "$root/requirements.lock"; "$python" --version) | sha256sum | cut -c1-16)
deps="$cache/deps-$key"
mkdir -p "$cache"
# Two clones bootstrapping at once (a CI run beside a developer's) would each remove and rebuild the
# other's half-built environment; the second waits for the first and then reuses what it built.
exec 9>"$deps.lock"
flock 9
if [ ! -x "$deps/bin/python" ] || [ ! -f "$deps/.complete" ]; then
  echo "bootstrap: building $deps (cold machine: downloads torch, a few minutes)" >&2
  rm -rf "$deps"
  "$python" -m venv "$deps"
  "$deps/bin/pip" install --quiet --cache-dir "$cache/pip" -r "$root/requirements.lock"
  touch "$deps/.complete"
else
  echo "bootstrap: reusing $deps" >&2
fi
exec 9>&-
deps_site=$("$deps/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

venv="$root/.venv"
if [ -L "$venv" ] || { [ -e "$venv" ] && [ "$(cat "$venv/.deps" 2>/dev/null)" != "$deps" ]; }; then
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv --without-pip "$venv"
  echo "$deps" > "$venv/.deps"
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$deps_site')" > "$site/trainguard-deps.pth"
# ruff is a native binary: the shared one serves every clone. Python tools run under this clone's
# interpreter (so they import this clone's code), through small wrappers.
ln -sfn "$deps/bin/ruff" "$venv/bin/ruff"
for tool in pytest:pytest mypy:mypy torchrun:torch.distributed.run; do
  printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m %s "$@"\n' "${tool#*:}" > "$venv/bin/${tool%%:*}"
  chmod +x "$venv/bin/${tool%%:*}"
done
# import-linter has no `python -m` entry point; its console script's function, run the same way.
printf '#!/bin/sh\nexec "$(dirname "$0")/python" -c "from importlinter.cli import lint_imports_command; lint_imports_command()" "$@"\n' > "$venv/bin/lint-imports"
chmod +x "$venv/bin/lint-imports"
# The project itself, editable, into this clone's .venv only (cheap, so on every run).
"$deps/bin/pip" --python "$venv/bin/python" install --quiet --no-deps --no-build-isolation -e "$root"

mkdir -p "$root/build/mypy"
ln -sfn ../../operator "$root/build/mypy/trainguard_operator"
