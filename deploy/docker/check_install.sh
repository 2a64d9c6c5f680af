#!/usr/bin/env bash
# Runs the CPU image's install command (deploy/docker/Dockerfile, its `RUN pip install` line)
# for real in a fresh venv, /src being a copy of this checkout, then checks the result imports and runs.
# Slow (it downloads torch, ray, nixl ...): tests/deploy only resolves the same command with
# --dry-run. Everything goes in a temporary directory, removed at the end (KEEP_VENV=1 keeps it).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dockerfile="$root/deploy/docker/Dockerfile"

cmd="$(sed -n 's/^RUN \(pip install .*\)$/\1/p' "$dockerfile")"
if [ -z "$cmd" ] || [ "$(printf '%s\n' "$cmd" | wc -l)" -ne 1 ]; then
  echo "check_install: expected exactly one 'RUN pip install ...' line in $dockerfile" >&2
  exit 1
fi

work="$(mktemp -d)"
venv="$work/venv" src="$work/src"
[ "${KEEP_VENV:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
# The image's `COPY . /src`: the checkout's files (tracked, and untracked but not ignored), so
# that pip's build writes nothing into the working tree.
mkdir -p "$src"
git -C "$root" ls-files -z --cached --others --exclude-standard \
  | tar -C "$root" -cf - --null --no-recursion --ignore-failed-read -T - | tar -xf - -C "$src"
cmd="${cmd//\/src/$src}"

python3 -m venv "$venv"
# Out of the repo, so that the checks below import the installed package, not ./splitserve.
cd "$work"
# As the image does before it: pip itself upgraded first.
"$venv/bin/python" -m pip install --quiet --no-cache-dir --upgrade pip
echo "check_install: $cmd   (in $venv)"
start=$SECONDS
eval "\"$venv/bin/python\" -m $cmd"
echo "check_install: installed in $((SECONDS - start)) s"

"$venv/bin/python" - <<'PY'
import importlib.metadata as md

import ray
import torch

import splitserve
from splitserve.deploy import build_app  # noqa: F401  (the RayService's import_path)
from splitserve.v1 import generation_pb2_grpc  # noqa: F401  (generated at build time)

assert md.version("torch").startswith("2.13.0"), md.version("torch")
print(f"check_install: splitserve {md.version('splitserve')}, torch {torch.__version__}, ray {ray.__version__}, "
      f"nixl {md.version('nixl')}")
PY
"$venv/bin/splitserve" --version
"$venv/bin/ray" --version
echo "check_install: OK"
