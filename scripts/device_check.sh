#!/usr/bin/env bash
# The GPU checks as one run on a lent device machine (torch with CUDA installed there, no network):
# build against that torch, run the whole test suite (its CUDA cases run there), then the
# benchmarks (QUICK=1 by default: a lease is short; BENCH=0 skips them). Logs go to $OUT; the
# exit status is pytest's. Run from the repository root, e.g. through the device tool:
#   bash scripts/device_check.sh            (about 5 minutes on 16 cores)
set -uo pipefail
OUT=${OUT:-/tmp/dtorch-device-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install -q --no-build-isolation --no-deps -e . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
# One pytest per file: a crash in one file does not hide the others' results.
status=0
logs=$(mktemp -d)
for file in tests/test_*.py tests/gpu/test_*.py; do
  name=$(basename "$file" .py)
  python3 -m pytest "$file" -q -p no:cacheprovider -rfE --timeout 180 > "$logs/$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name: rc $rc: $(tail -1 "$logs/$name.log")"
  grep -E "^(FAILED|ERROR)|Fatal Python error" "$logs/$name.log" | head -20
  { echo "==== $name (rc $rc)"; cat "$logs/$name.log"; } >> "$OUT/tests.log"
done
echo "tests done: $(( $(date +%s) - start )) s"
if [ "${BENCH:-1}" = 1 ]; then
  QUICK=${QUICK:-1} timeout 240 python3 benchmarks/run_all.py 2>&1 | tee "$OUT/bench.log"
  echo "all done: $(( $(date +%s) - start )) s"
fi
exit $status
