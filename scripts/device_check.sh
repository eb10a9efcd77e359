#!/usr/bin/env bash
# The GPU checks as one run on a lent device machine (torch with CUDA installed there, no network):
# build against that torch, run the whole test suite (its CUDA cases run there), then the
# benchmarks (QUICK=1 by default: a lease is short; BENCH=0 skips them). Logs go to $OUT; the
# exit status is pytest's. Run scripts/fetch_device_deps.sh here first (Boost's headers), then
# from the repository root through the device tool, carrying .device:
#   bash scripts/device_check.sh            (about 5 minutes on 16 cores)
set -uo pipefail
OUT=${OUT:-/tmp/dtorch-device-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
start=$(date +%s)
# Boost's headers (the machine has none): from the Debian package scripts/fetch_device_deps.sh put
# in .device/ (carried along by the device tool), unpacked without installing it.
if [ ! -f /usr/include/boost/version.hpp ] && [ -z "${DTORCH_BOOST_INCLUDE:-}" ]; then
  deb=$(ls .device/libboost1.*-dev_*.deb 2>/dev/null | head -1)
  [ -n "$deb" ] || { echo "no Boost: run scripts/fetch_device_deps.sh here and carry .device"; exit 1; }
  rm -rf /tmp/dtorch-boost && mkdir -p /tmp/dtorch-boost
  if command -v dpkg >/dev/null; then
    dpkg -x "$deb" /tmp/dtorch-boost
  else  # a .deb is an ar archive holding data.tar.*
    python3 - "$deb" /tmp/dtorch-boost <<'PY'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
pos = 8  # "!<arch>\n"
while pos < len(data):
    name, size = data[pos:pos + 16].decode().strip(), int(data[pos + 48:pos + 58])
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(body)).extractall(sys.argv[2])
    pos += 60 + size + (size & 1)
PY
  fi
  export DTORCH_BOOST_INCLUDE=/tmp/dtorch-boost/usr/include
  echo "boost: $(awk '/define BOOST_LIB_VERSION/{print $3}' $DTORCH_BOOST_INCLUDE/boost/version.hpp)"
fi
MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install -q --no-build-isolation --no-deps -e . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
# One pytest per file: a crash in one file does not hide the others' results.
status=0
logs=$(mktemp -d)
for file in tests/test_*.py tests/gpu/test_*.py; do
  name=$(basename "$file" .py)
  # Packaging (a wheel built and installed into a venv) has no GPU case and would cost minutes.
  [ "$name" = test_packaging ] && continue
  python3 -m pytest "$file" -q -p no:cacheprovider -rfE --timeout 180 > "$logs/$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name: rc $rc: $(tail -1 "$logs/$name.log")"
  grep -E "^(FAILED|ERROR)|Fatal Python error" "$logs/$name.log" | head -20
  { echo "==== $name (rc $rc)"; cat "$logs/$name.log"; } >> "$OUT/tests.log"
done
echo "tests done: $(( $(date +%s) - start )) s"
if [ "${BENCH:-1}" = 1 ]; then
  QUICK=${QUICK:-1} timeout 240 python3 benchmarks/run_all.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
  echo "all done: $(( $(date +%s) - start )) s"
fi
exit $status
