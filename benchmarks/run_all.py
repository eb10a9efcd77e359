"""Runs every benchmark. Each figure is a ratio against an anchor measured in the same run
(cases interleaved, medians); timing is reported, never asserted. QUICK=1 shortens every run."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_asyncio  # noqa: E402
import bench_compile  # noqa: E402
import bench_completion  # noqa: E402
import bench_file  # noqa: E402
import bench_roundtrip  # noqa: E402
import bench_sync  # noqa: E402
import bench_wake  # noqa: E402


def main():
    quick = os.environ.get("QUICK") == "1"
    bench_roundtrip.main(rounds=3 if quick else 7, calls=500 if quick else 2000)
    bench_wake.main(samples=60 if quick else 300)
    bench_asyncio.main(samples=30 if quick else 150, pending=1000, seconds=0.3 if quick else 1.0)
    bench_sync.main(rounds=3 if quick else 7, calls=300 if quick else 1000,
                    samples=10 if quick else 50)
    bench_completion.main(samples=(60, 10, 3) if quick else (300, 60, 12),
                          seconds=0.3 if quick else 1.0)
    bench_file.main(rounds=3 if quick else 5, samples=60 if quick else 200,
                    sizes_mib=(1, 64) if quick else (1, 64, 512), repeats=3 if quick else 6,
                    pending=1000 if quick else 10_000)
    bench_compile.main(steps=10 if quick else 30, rounds=3 if quick else 5,
                       backend="aot_eager" if quick else "inductor")
    bench_compile.main_future_in_graph(rounds=3 if quick else 7, calls=100 if quick else 300,
                                       backend="aot_eager" if quick else "inductor")


if __name__ == "__main__":
    main()
