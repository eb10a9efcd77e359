#!/usr/bin/env bash
# Builds and installs dtorch_ops (editable) into $PYTHON, unless the built library is newer than
# every source and imports.
set -euo pipefail
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."

lib=dtorch_ops/libdtorch_ops.so
if [ -f "$lib" ] && [ -d dtorch_ops/share/cmake ] \
   && [ -z "$(find csrc cmake setup.py pyproject.toml -newer "$lib" -type f | head -1)" ] \
   && "$PYTHON" -c "import dtorch_ops" 2>/dev/null; then
  echo "build: dtorch_ops is up to date"
  exit 0
fi
MAX_JOBS=${MAX_JOBS:-2} "$PYTHON" -m pip install -q --no-build-isolation -e .
"$PYTHON" -c "import dtorch_ops; print('build: dtorch_ops', dtorch_ops.library_path())"
