"""The benchmarks run (tiny sizes): they must not rot between `make bench` runs. Nothing here
asserts a timing; only that every figure is produced and nothing is left behind."""
import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


@pytest.mark.timeout(180)
def test_the_file_kind_benchmark_runs(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # (also for its spawned producer, which imports it)
    import bench_file

    result = bench_file.main(rounds=1, samples=5, sizes_mib=(1,), repeats=2, pending=200)
    assert set(result["latency_us"]) == {"file", "await", "queue", "pipe"}
    for how, figures in result["latency_us"].items():
        assert figures["median"] > 0, how
    assert result["bandwidth"]["1MiB"]["steady_gbps"]["file"] > 0
    assert result["producer_segments_left"] == []
    assert result["memory"]["segments_left"] == []
    assert result["memory"]["per_future"]["own_segments"] == 1.0  # one control segment each
