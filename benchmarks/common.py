"""Helpers shared by the benchmarks: interleaved rounds, and the figures each benchmark records in
a Report (benchmarks/report.py writes them out as REPORT.md, REPORT.json and REPORT.png).

A Figure is one thing we measure: our samples, the samples of the anchors measured beside it in
the same run, and the targets the issues set, on the ratio to an anchor or on our own median.
Nothing here is typed in by hand but the targets, each with the issue that set it."""
import dataclasses
import operator
import statistics
import time

_COMPARATORS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge}


def per_call_us(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def interleaved_samples(cases, rounds, measure):
    """measure(fn) -> one sample; cases run in turn each round; returns {name: [samples]}."""
    samples = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(measure(fn))
    return samples


def print_medians(title, samples, unit):
    print(f"\n{title}")
    for name, values in samples.items():
        print(f"  {name:>34}: {statistics.median(values):9.2f} {unit}")


def proc_status_bytes(field):
    """A kB field of /proc/self/status (VmRSS, RssShmem, ...) in bytes; 0 where absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


@dataclasses.dataclass(frozen=True)
class Stats:
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples):
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))


@dataclasses.dataclass(frozen=True)
class Target:
    """`comparator threshold`, set by `issue`. On an Anchor it bounds the ratio; on a Figure, our
    median itself. `condition` names where the issue meant it to hold (e.g. "on a GPU"); where it
    does not hold here, applies is False and the figure is reported, not judged."""
    comparator: str
    threshold: float
    issue: int
    condition: str = ""
    applies: bool = True

    def met(self, value):
        """True/False, or None when the target does not apply here or there is no value."""
        if not self.applies or value is None:
            return None
        return _COMPARATORS[self.comparator](value, self.threshold)

    def describe(self, unit="x"):
        where = f" {self.condition}" if self.condition else ""
        return f"{self.comparator} {self.threshold:g}{unit}{where} (issue {self.issue})"


def _verdict(target, value, unit="x"):
    """What a terminal line says about a value against its target."""
    if target is None:
        return "report only"
    met = target.met(value)
    state = {True: "met", False: "MISSED", None: "not judged here"}[met]
    return f"target {target.describe(unit)}: {state}"


@dataclasses.dataclass
class Anchor:
    """What our figure is compared with, measured in the same run. The ratio is ours / anchor, or
    anchor / ours with inverse (how many times faster or lower we are)."""
    name: str
    samples: list
    target: Target | None = None
    inverse: bool = False
    size_independent: bool = False  # moves a fixed message, not the tensor: a flat line in the plot

    @property
    def stats(self):
        return Stats.of(self.samples)

    def ratio(self, ours_median):
        mine, theirs = ours_median, self.stats.median
        if self.inverse:
            mine, theirs = theirs, mine
        return mine / theirs if theirs else None


@dataclasses.dataclass
class Figure:
    section: str
    name: str
    unit: str
    ours: str  # which of our cases the samples are
    samples: list
    anchors: list = dataclasses.field(default_factory=list)
    target: Target | None = None  # on our median itself (a share of a core, a thread count)
    size_bytes: int | None = None  # the tensor's size: the plot puts the figure at this size
    size_independent: bool = False  # the value is not copied: the plot draws a flat line

    @property
    def stats(self):
        return Stats.of(self.samples)


class Report:
    """Collects the figures of a run, in the order recorded, and prints each one's verdicts."""

    def __init__(self):
        self.figures = []

    def add(self, figure):
        self.figures.append(figure)
        median = figure.stats.median
        if figure.target is not None:
            print(f"  => {figure.name}: {median:.3g} {figure.unit} "
                  f"({_verdict(figure.target, median, ' ' + figure.unit)})")
        for anchor in figure.anchors:
            ratio = anchor.ratio(median)
            shown = "n/a" if ratio is None else f"{ratio:.2f}x"
            direction = f"{anchor.name} / ours" if anchor.inverse else f"ours / {anchor.name}"
            print(f"  => {figure.name}, {direction}: {shown} "
                  f"({_verdict(anchor.target, ratio)})")
