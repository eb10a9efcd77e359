#!/usr/bin/env bash
# Builds dtorch_ops against another torch and runs the whole test suite, in a throwaway venv and a
# copy of the checkout (the main environment's install is left as it is); both are deleted after.
#   bash scripts/compat.sh 2.11.0        (PyPI's CUDA wheels run on a CPU-only machine; ~5 GB)
#   bash scripts/compat.sh 2.15.0 tests/test_compile_raw_ops.py    (those test files only)
# PYTHON picks the interpreter the venv is made from (default: python3). This machine's pip caps
# torch's version: the one install here lifts the cap (PIP_CONSTRAINT=/dev/null).
set -euo pipefail
VERSION=${1:?usage: scripts/compat.sh TORCH_VERSION [pytest args...]}
shift
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/dtorch-compat.XXXXXX)
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m venv "$work/venv"
PIP_CONSTRAINT=/dev/null "$work/venv/bin/python" -m pip install -q --disable-pip-version-check \
  "torch==$VERSION" pytest pytest-timeout ninja "setuptools>=64" wheel numpy
mkdir "$work/src"
git ls-files --cached --others --exclude-standard -z | xargs -0 cp --parents -t "$work/src"
cd "$work/src"
echo "compat: torch $("$work/venv/bin/python" -c 'import torch; print(torch.__version__)'), \
$("$work/venv/bin/python" --version)"
MAX_JOBS=${MAX_JOBS:-2} "$work/venv/bin/python" -m pip install -q --no-build-isolation --no-deps \
  -e . > "$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
# (pytest's testpaths: the whole suite, or the test files named)
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
