#!/usr/bin/env bash
# The GPU checks, in stages, as one run on a lent GPU machine (torch with CUDA installed there,
# Python >= 3.11 (3.12 there), no Boost, no network), within 7 minutes on 16 cores (on the H200
# machine: build 57-70 s, tests/gpu 100-160 s, the suite the rest):
#   environment  Python (>= 3.11), torch, CUDA, the GPU; refuses (exit 2) when torch sees no GPU
#   build        Boost's headers unpacked from .device/ (the Debian package, not installed), then
#                pip install --no-build-isolation --no-deps -e . against that torch (57-70 s measured)
#   simdev       the simulated device of the tests (tests/simdev), compiled once before the tests
#   gpu          tests/gpu/test_*.py on CUDA (DTORCH_GPU_TESTS=cuda), one pytest per file, alone
#                on the GPU (timing checks) and before the suite (the core of the check)
#   suite        the test suite, whose CUDA cases run there: tests/test_*.py but test_packaging (no
#                GPU case, minutes) and test_benchmarks (what the bench stage runs), one pytest
#                per file under a time limit, JOBS files at a time, longest first
#   bench        benchmarks/run_all.py, QUICK=1 (about 1 min, estimated; completion latency, the library's CPU
#                while work is pending, the compiled step's logging...) into $OUT
# Run scripts/fetch_device_deps.sh here first (Boost's headers into .device/), then from the
# repository root through the device tool, carrying .device:
#   bash scripts/device_check.sh       (timeout_s 480: the script stops itself at BUDGET_S=420)
# and read $OUT/device_check.json. A rerun on a machine still warm: BUILD=0 skips the build.
#
# --simdev: the checks that do not need CUDA, on the simulated device, for CI (no GPU; `make test`
# runs it), within BUDGET_S=150 (about 25 s on 2 cores): no build (the checkout's package as
# built), no suite; the stages environment (no GPU needed), simdev, gpu (tests/gpu with
# DTORCH_GPU_TESTS=simdev: its CUDA-only tests skip, saying why) and bench (the simulated device's
# benchmark, benchmarks/bench_completion.py with QUICK sizes, as REPORT.json/.md/.png).
#
# Results: $OUT/device_check.json (OUT: /tmp/dtorch-device-check by default), a JSON list of
# records, rewritten whole (a temporary file, then a rename) after every stage and every test
# file, so that it is valid JSON at all times and a run cut short still reports what finished:
#   {"stage": "environment" | "build" | "simdev" | "tests/gpu/test_x.py" | "gpu" |
#             "tests/test_x.py" | "suite" | "bench" | "total",
#    "ok": true | false | null (skipped on purpose), "seconds": 12.3, "summary": "one line",
#    and where they apply "rc", "log" (its file in $OUT), "failures" (pytest's FAILED/ERROR
#    lines), "not_run" (the time budget was spent), the environment's python/torch/cuda/gpu/...}
# The last record is {"stage": "total", "exit": N, ...}: a list without it was cut short.
# Logs beside it: build.log, gpu.log, tests.log, bench.log; REPORT.json/.md/.png from the
# benchmarks (8 files: what the device tool brings back at most). Exit status: 0 when every stage
# passed, 1 when one failed, 2 for a refusal (no GPU without --simdev) or a bad argument.
# Settings (environment): OUT, PYTHON (python3), BUDGET_S, BUILD (0 skips the build), MAX_JOBS
# (the build's, 16), JOBS (suite files at a time: cores/2, at most 8), FILE_TIMEOUT_S (a suite
# file's limit, 200), BENCH_RESERVE_S (what the suite leaves to the bench, 90), BENCH (0 skips
# the bench), QUICK (1; 0 runs the full benchmarks: minutes).
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.." || exit 2

usage() {
  echo "usage: bash scripts/device_check.sh [--simdev]   (see the comment at its top)"
}
SIMDEV=0
for arg in "$@"; do
  case "$arg" in
    --simdev) SIMDEV=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "device_check: unknown argument: $arg" >&2; usage >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/dtorch-device-check}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
RESULTS=$OUT/device_check.json
WORK=$(mktemp -d /tmp/dtorch-device-check-work.XXXXXX) || exit 2
trap 'rm -rf "$WORK"' EXIT
rm -f "$RESULTS" "$RESULTS.tmp" "$OUT"/{build,gpu,tests,bench}.log "$OUT"/REPORT.{json,md,png}
echo "[]" > "$RESULTS.tmp" && mv "$RESULTS.tmp" "$RESULTS" || exit 2
# The checkout's package, also in subprocesses started from other folders (benchmarks, producers),
# whatever an earlier editable install elsewhere left on the path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHON OUT RESULTS WORK
if [ "$SIMDEV" = 1 ]; then MODE=simdev; BUDGET_S=${BUDGET_S:-150}; else MODE=cuda; BUDGET_S=${BUDGET_S:-420}; fi
CORES=$(nproc 2>/dev/null || echo 2)

# ---- results: record.py appends one record under a lock (test files finish in parallel) ----
cat > "$WORK/record.py" <<'PY'
"""record.py STAGE OK SECONDS SUMMARY [--log NAME] [--rc N] [--extra JSON] [--failures-from LOG]
[--append-log LOG --title TITLE]: appends a record to $RESULTS (and LOG to $OUT/NAME)."""
import argparse, fcntl, json, os, re, sys

parser = argparse.ArgumentParser()
for name in ("stage", "ok", "seconds", "summary"):
    parser.add_argument(name)
parser.add_argument("--log")
parser.add_argument("--rc", type=int)
parser.add_argument("--extra", default="{}")
parser.add_argument("--failures-from")
parser.add_argument("--append-log")
parser.add_argument("--title", default="")
args = parser.parse_args()
record = {"stage": args.stage, "ok": {"true": True, "false": False}.get(args.ok),
          "seconds": round(float(args.seconds), 1), "summary": args.summary}
if args.rc is not None:
    record["rc"] = args.rc
if args.log:
    record["log"] = args.log
if args.failures_from:
    with open(args.failures_from, errors="replace") as f:
        lines = [line.rstrip() for line in f
                 if re.match(r"(FAILED|ERROR) |Fatal Python error|E +Failed: Timeout|\++ Timeout",
                             line)]
    if lines:
        record["failures"] = lines[:20]
record.update(json.loads(args.extra))
results = os.environ["RESULTS"]
with open(os.path.join(os.environ["WORK"], "lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if args.append_log:
        with open(args.append_log, errors="replace") as f, \
                open(os.path.join(os.environ["OUT"], args.log), "a") as out:
            out.write(f"==== {args.title or args.stage} (rc {args.rc})\n{f.read()}\n")
    try:
        with open(results) as f:
            records = json.load(f)
    except FileNotFoundError:
        records = []
    records.append(record)
    with open(results + ".tmp", "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    os.replace(results + ".tmp", results)
PY
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
record() { "$PYTHON" "$WORK/record.py" "$@"; }
START=$(now)
DEADLINE=$(awk -v a="$START" -v b="$BUDGET_S" 'BEGIN { printf "%d", a + b }')
# Seconds left before the deadline, less 10 (what `timeout -k 10` may add, and the records).
left() { awk -v d="$DEADLINE" -v n="$(now)" 'BEGIN { printf "%d", d - n - 10 }'; }
# A stage's time limit: its own, or what is left of the budget if less.
limit() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
export -f now since record left limit
export DEADLINE
FAILED=()
finish() {  # exit status [summary]
  local summary failed
  if [ "$1" = 0 ]; then summary="all stages passed"; else summary="failed: ${FAILED[*]}"; fi
  summary=${2:-$summary}
  failed=""
  for stage in "${FAILED[@]}"; do failed+="\"$stage\", "; done
  record total "$([ "$1" = 0 ] && echo true || echo false)" "$(since "$START")" "$summary" \
    --extra "{\"exit\": $1, \"mode\": \"$MODE\", \"failed\": [${failed%, }]}"
  echo "device_check ($MODE): $summary; exit $1 after $(since "$START") s; results: $RESULTS"
  exit "$1"
}
# pytest's last line ("3 passed, 1 skipped in 2.10s"), without its = rules.
last_line() { tail -1 "$1" 2>/dev/null | sed -E 's/^=+ //; s/ =+$//'; }

# ---- environment ----
t=$(now)
env_json=$("$PYTHON" - "$MODE" <<'PY'
import json, os, platform, sys
info = {"mode": sys.argv[1], "python": platform.python_version(), "executable": sys.executable,
        "cores": os.cpu_count()}
problems = []
if sys.version_info < (3, 11):
    problems.append(f"Python {info['python']} is older than 3.11 (pyproject.toml's requires-python)")
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda,
                gpu_visible=torch.cuda.is_available())
    if info["gpu_visible"]:
        info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count())
except Exception as e:  # noqa: BLE001 - reported
    problems.append(f"torch does not import: {type(e).__name__}: {e}")
refused = not problems and sys.argv[1] == "cuda" and not info["gpu_visible"]
if refused:
    problems.append(f"no GPU visible: torch.cuda.is_available() is False (torch {info['torch']}, "
                    f"CUDA {info['cuda']}); run this on a GPU machine, or --simdev for the "
                    "simulated device")
info["summary"] = "; ".join(problems) or (
    f"Python {info['python']}, torch {info['torch']}, CUDA {info['cuda']}, "
    + (f"{info['gpus']} x {info['gpu']}" if info.get("gpu_visible") else "no GPU")
    + f", {info['cores']} cores")
info["status"] = "refused" if refused else "fail" if problems else "ok"
print(json.dumps(info))
PY
) || env_json='{"status": "fail", "summary": "the Python check itself failed"}'
env_status=$("$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["status"])' "$env_json")
env_summary=$("$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["summary"])' "$env_json")
echo "environment: $env_summary"
record environment "$([ "$env_status" = ok ] && echo true || echo false)" "$(since "$t")" \
  "$env_summary" --extra "$env_json"
if [ "$env_status" = refused ]; then
  echo "device_check: REFUSED: $env_summary" >&2
  FAILED+=(environment)
  finish 2 "refused: no GPU visible"
fi
[ "$env_status" = ok ] || { FAILED+=(environment); finish 1; }

# ---- build (GPU only; BUILD=0 skips it: a rerun on a machine still warm) ----
if [ "$MODE" = cuda ] && [ "${BUILD:-1}" != 1 ]; then
  record build null 0 "skipped (BUILD=${BUILD}): the package as built before"
elif [ "$MODE" = cuda ]; then
  t=$(now)
  boost=""
  # Boost's headers (the machine has none): from the Debian package scripts/fetch_device_deps.sh
  # put in .device/ (carried along by the device tool), unpacked without installing it.
  if [ ! -f /usr/include/boost/version.hpp ] && [ -z "${DTORCH_BOOST_INCLUDE:-}" ]; then
    debs=(.device/libboost1.*-dev_*.deb)
    deb=${debs[0]:-}
    if [ -z "$deb" ]; then
      record build false "$(since "$t")" \
        "no Boost: run scripts/fetch_device_deps.sh here and carry .device"
      FAILED+=(build); finish 1
    fi
    rm -rf /tmp/dtorch-boost && mkdir -p /tmp/dtorch-boost
    if command -v dpkg >/dev/null; then
      dpkg -x "$deb" /tmp/dtorch-boost
    else  # a .deb is an ar archive holding data.tar.*
      "$PYTHON" - "$deb" /tmp/dtorch-boost <<'PY'
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
    boost="Boost $(awk '/define BOOST_LIB_VERSION/{print $3}' "$DTORCH_BOOST_INCLUDE/boost/version.hpp" | tr -d '"') from $deb; "
  fi
  MAX_JOBS=${MAX_JOBS:-16} timeout -k 10 "$(limit 240)" "$PYTHON" -m pip install -q \
    --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    tail -40 "$OUT/build.log"
    record build false "$(since "$t")" "${boost}pip install -e . failed (rc $rc)" --rc $rc \
      --log build.log --extra "{\"tail\": $(tail -15 "$OUT/build.log" | "$PYTHON" -c 'import json, sys; print(json.dumps(sys.stdin.read()))')}"
    FAILED+=(build); finish 1
  fi
  record build true "$(since "$t")" "${boost}pip install -e . built" --rc 0 --log build.log
  echo "build: $(since "$t") s"
fi

# ---- simdev: the simulated device, compiled (once) before the tests use it ----
t=$(now)
{ echo "==== simdev (tests/simdev)"; } >> "$OUT/build.log"
timeout -k 10 "$(limit 180)" "$PYTHON" -c \
  "import sys; sys.path.insert(0, 'tests'); import simdev; simdev.load(); print('simdev loaded')" \
  >> "$OUT/build.log" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
  record simdev true "$(since "$t")" "the simulated device built and loaded" --rc 0 --log build.log
else
  tail -30 "$OUT/build.log"
  record simdev false "$(since "$t")" "the simulated device did not build or load (rc $rc)" \
    --rc $rc --log build.log
  FAILED+=(simdev)
  # On a GPU the suite still runs its CUDA cases (tests/conftest.py warns); --simdev has nothing.
  [ "$MODE" = simdev ] && finish 1
fi
echo "simdev: $(since "$t") s"

# ---- one test file: pytest under a time limit, a record, its log appended ----
# run_test_file FILE LOG_NAME FILE_TIMEOUT_S
run_test_file() {
  local file=$1 log_name=$2 t rc seconds summary ok log limit_s
  t=$(now)
  log="$WORK/$(echo "$file" | tr / _).log"
  limit_s=$(limit "$3")
  if [ "$limit_s" -lt 5 ]; then
    record "$file" false 0 "not run: the time budget (BUDGET_S) was spent" \
      --extra '{"not_run": true}'
    echo "$file: not run (time budget)"
    return 1
  fi
  timeout -k 10 "$limit_s" "$PYTHON" -m pytest "$file" -q -p no:cacheprovider -rfEs \
    --timeout "$(( limit_s > 150 ? 150 : limit_s ))" > "$log" 2>&1
  rc=$?
  seconds=$(since "$t")
  case $rc in
    0|5) ok=true; summary=$(last_line "$log") ;;  # 5: nothing collected (all deselected)
    124|137) ok=false; summary="timed out after ${limit_s} s (last: $(last_line "$log"))" ;;
    *) ok=false; summary=$(last_line "$log") ;;
  esac
  record "$file" "$ok" "$seconds" "$summary" --rc $rc --log "$log_name" \
    --failures-from "$log" --append-log "$log" --title "$file"
  echo "$file: rc $rc, ${seconds} s: $summary"
  grep -E "^(FAILED|ERROR) |Fatal Python error" "$log" | head -10
  [ "$ok" = true ]
}
export -f run_test_file last_line

# ---- gpu: tests/gpu, one file at a time ----
t=$(now)
if [ "$MODE" = cuda ]; then gpu_file_limit=150; else gpu_file_limit=90; fi
passed=0 failed=()
for file in tests/gpu/test_*.py; do
  if DTORCH_GPU_TESTS=$MODE run_test_file "$file" gpu.log "$gpu_file_limit"; then
    passed=$((passed + 1))
  else
    failed+=("$(basename "$file")")
  fi
done
if [ ${#failed[@]} -eq 0 ]; then
  record gpu true "$(since "$t")" "tests/gpu on $MODE: $passed files passed" --log gpu.log
else
  record gpu false "$(since "$t")" "tests/gpu on $MODE: ${#failed[@]} of $((passed + ${#failed[@]})) files failed: ${failed[*]}" --log gpu.log
  FAILED+=(gpu)
fi

# ---- suite (GPU only): the top-level test files, JOBS at a time, longest first ----
if [ "$MODE" = cuda ]; then
  t=$(now)
  JOBS=${JOBS:-$(( CORES / 2 > 8 ? 8 : (CORES / 2 < 1 ? 1 : CORES / 2) ))}
  # Longest first, as measured (a file not named here runs after these): most of a file's time
  # is subprocesses starting and waiting, so JOBS files share the cores, with a few threads each
  # and inductor compiling in the test's process.
  order=(test_python_layer test_file_device test_compile_futures test_compile test_parity
    test_file_kind test_file_failures test_file_payloads test_cpp_api test_threads test_torchscript
    test_sync)
  files=()
  for name in "${order[@]}"; do [ -f "tests/$name.py" ] && files+=("tests/$name.py"); done
  for file in tests/test_*.py; do
    name=$(basename "$file" .py)
    case " test_packaging test_benchmarks ${order[*]} " in *" $name "*) continue ;; esac
    files+=("$file")
  done
  # The bench stage keeps BENCH_RESERVE_S of the budget (its QUICK run: about 60 s).
  [ "${BENCH:-1}" = 1 ] || BENCH_RESERVE_S=0
  suite_budget=$(( $(left) - ${BENCH_RESERVE_S:-90} ))
  echo "suite: ${#files[@]} files, $JOBS at a time, within ${suite_budget} s"
  # shellcheck disable=SC2016  # $1 and FILE_TIMEOUT_S expand in the child bash
  printf '%s\n' "${files[@]}" | \
    DEADLINE=$(( DEADLINE - ${BENCH_RESERVE_S:-90} )) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
    TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1} \
    xargs -P "$JOBS" -I{} bash -c 'run_test_file "$1" tests.log "${FILE_TIMEOUT_S:-200}"' _ {}
  summary=$("$PYTHON" - "${#files[@]}" "$JOBS" <<'PY'
import json, os, sys
files = [r for r in json.load(open(os.environ["RESULTS"])) if r["stage"].startswith("tests/test_")]
failed = [os.path.basename(r["stage"]) for r in files if not r["ok"] and not r.get("not_run")]
not_run = [os.path.basename(r["stage"]) for r in files if r.get("not_run")]
passed = len(files) - len(failed) - len(not_run)
print(f"{passed} of {sys.argv[1]} files passed ({sys.argv[2]} at a time)"
      + (f"; failed: {' '.join(failed)}" if failed else "")
      + (f"; not run (time budget): {' '.join(not_run)}" if not_run else "")
      + ("" if len(files) == int(sys.argv[1]) else f"; {int(sys.argv[1]) - len(files)} unreported"))
PY
)
  if [[ "$summary" == "${#files[@]} of ${#files[@]} files passed"* ]]; then
    record suite true "$(since "$t")" "$summary" --log tests.log
  else
    record suite false "$(since "$t")" "$summary" --log tests.log
    FAILED+=(suite)
  fi
  echo "suite: $(since "$t") s: $summary"
fi

# ---- bench ----
t=$(now)
if [ "${BENCH:-1}" != 1 ]; then
  record bench null 0 "skipped (BENCH=${BENCH})"
elif [ "$(left)" -lt 20 ]; then
  record bench false 0 "not run: the time budget (BUDGET_S) was spent"
  FAILED+=(bench)
else
  if [ "$MODE" = cuda ]; then
    QUICK=${QUICK:-1} timeout -k 10 "$(limit 240)" "$PYTHON" benchmarks/run_all.py --out "$OUT" \
      > "$OUT/bench.log" 2>&1
    rc=$?
  else
    timeout -k 10 "$(limit 90)" "$PYTHON" - > "$OUT/bench.log" 2>&1 <<'PY'
# The simulated device's benchmark (benchmarks/bench_completion.py), QUICK sizes, as a report.
import os, sys, time
sys.path.insert(0, "benchmarks")
import bench_completion
import report as report_files
from common import Report

report, start = Report(), time.perf_counter()
bench_completion.main(report, samples=(60, 10, 3), seconds=0.3)
paths = report_files.write(report, os.environ["OUT"], True, time.perf_counter() - start)
print("\nreport: " + ", ".join(paths))
PY
    rc=$?
  fi
  summary=$("$PYTHON" - "$rc" <<'PY'
import json, os, sys
try:
    data = json.load(open(os.path.join(os.environ["OUT"], "REPORT.json")))
    s = data["summary"]
    print(f"{', '.join(data['sections'])}: {s['met']} of {s['targets']} targets met"
          + (f" (missed: {'; '.join(s['missed'][:3])}{'; ...' if len(s['missed']) > 3 else ''})"
             if s["missed"] else "")
          + " (REPORT.md)")
except Exception as e:  # noqa: BLE001 - the run failed before writing its report
    print(f"no report (rc {sys.argv[1]}{', timed out' if sys.argv[1] in ('124', '137') else ''})")
PY
)
  if [ $rc -eq 0 ]; then
    record bench true "$(since "$t")" "$summary" --rc 0 --log bench.log
  else
    tail -30 "$OUT/bench.log"
    record bench false "$(since "$t")" "$summary" --rc $rc --log bench.log
    FAILED+=(bench)
  fi
  echo "bench: rc $rc, $(since "$t") s: $summary"
fi

if [ ${#FAILED[@]} -eq 0 ]; then finish 0; else finish 1; fi
