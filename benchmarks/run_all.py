"""Runs every benchmark and writes the report (REPORT.md, REPORT.json, REPORT.png; see report.py)
into benchmarks/, or the folder given by --out or $REPORT_DIR. Each figure is a ratio against an
anchor measured in the same run (cases interleaved, medians); timing is reported, never asserted.
QUICK=1 runs everything once with small sizes."""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_asyncio  # noqa: E402
import bench_compile  # noqa: E402
import bench_completion  # noqa: E402
import bench_file  # noqa: E402
import bench_network  # noqa: E402
import bench_roundtrip  # noqa: E402
import bench_scale  # noqa: E402
import bench_sync  # noqa: E402
import bench_wake  # noqa: E402
import report as report_files  # noqa: E402
from common import Report  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("REPORT_DIR", HERE),
                        help="folder for REPORT.md/.json/.png "
                             "(default: $REPORT_DIR, else benchmarks/)")
    out = parser.parse_args().out
    quick = os.environ.get("QUICK") == "1"
    report = Report()
    start = time.perf_counter()
    bench_roundtrip.main(report, rounds=3 if quick else 7, calls=500 if quick else 2000)
    bench_wake.main(report, samples=60 if quick else 300)
    bench_asyncio.main(report, samples=30 if quick else 150, pending=1000,
                       seconds=0.3 if quick else 1.0)
    bench_sync.main(report, rounds=3 if quick else 7, calls=300 if quick else 1000,
                    samples=10 if quick else 50)
    bench_completion.main(report, samples=(60, 10, 3) if quick else (300, 60, 12),
                          seconds=0.3 if quick else 1.0)
    bench_file.main(report, rounds=3 if quick else 5, samples=60 if quick else 200,
                    sizes_mib=(1, 64) if quick else (1, 64, 512), repeats=3 if quick else 6)
    bench_network.main(report, rounds=3 if quick else 5, samples=30 if quick else 100,
                       mib=16 if quick else 64, repeats=5 if quick else 7)
    bench_compile.main(report, steps=10 if quick else 30, rounds=3 if quick else 5,
                       backend="aot_eager" if quick else "inductor")
    bench_compile.main_future_in_graph(report, rounds=3 if quick else 7,
                                       calls=100 if quick else 300,
                                       backend="aot_eager" if quick else "inductor")
    bench_scale.main(report, pending=10_000 if quick else 100_000,
                     file_pending=1000 if quick else 10_000, repeats=1 if quick else 3,
                     count=2000 if quick else 20_000, rounds=2 if quick else 5)
    paths = report_files.write(report, out, quick, time.perf_counter() - start)
    print("\nreport: " + ", ".join(paths))


if __name__ == "__main__":
    main()
