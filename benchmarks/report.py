"""Writes a run's figures (common.Report) out: REPORT.json (every figure, for programs), REPORT.md
(the same, for people, rendered from the JSON's content so the two cannot disagree) and REPORT.png
(latency and bandwidth against tensor size, log-log: the file kind and its anchors, and the
memory kind's round trip, which copies nothing and so does not depend on the size)."""
import dataclasses
import datetime
import importlib.util
import itertools
import json
import os
import platform
import subprocess

import torch

from common import Stats, Target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS_MD = {"us": "µs"}


# ---- the machine ----


def _cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _commit():
    """The checkout's commit, "-dirty" when it has uncommitted changes; None outside git."""
    try:
        return subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine(quick, seconds):
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "commit": _commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "mode": "QUICK" if quick else "full",
        "duration_s": round(seconds, 1),
    }


# ---- JSON ----


def _target_json(target):
    return None if target is None else dataclasses.asdict(target)


def _figure_json(figure):
    ours = figure.stats
    anchors = []
    for anchor in figure.anchors:
        ratio = anchor.ratio(ours.median)
        anchors.append({"name": anchor.name, **dataclasses.asdict(anchor.stats), "ratio": ratio,
                        "ratio_of": "anchor / ours" if anchor.inverse else "ours / anchor",
                        "target": _target_json(anchor.target),
                        "met": anchor.target.met(ratio) if anchor.target else None})
    return {"name": figure.name, "unit": figure.unit,
            "ours": {"label": figure.ours, **dataclasses.asdict(ours)},
            "target": _target_json(figure.target),
            "met": figure.target.met(ours.median) if figure.target else None,
            "anchors": anchors, "size_bytes": figure.size_bytes}


def _judged(sections):
    """(section, figure, anchor, met) of every target that applies here; anchor None: the target
    on our own median."""
    for section, figures in sections.items():
        for figure in figures:
            for anchor in [None] + figure["anchors"]:
                target = (anchor or figure)["target"]
                if target is not None and target["applies"]:
                    yield section, figure, anchor, (anchor or figure)["met"]


def as_json(report, quick, seconds):
    sections = {}
    for figure in report.figures:
        sections.setdefault(figure.section, []).append(_figure_json(figure))
    judged = list(_judged(sections))
    missed = [f"{section}: {figure['name']}" + (f" vs {anchor['name']}" if anchor else "")
              for section, figure, anchor, met in judged if not met]
    return {"machine": machine(quick, seconds),
            "summary": {"targets": len(judged), "met": len(judged) - len(missed),
                        "missed": missed},
            "sections": sections}


# ---- Markdown ----


def _number(value):
    if value is None:
        return "—"
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:#.3g}"  # (#: keeps trailing zeros, 5.70)


def _unit_md(unit):
    return UNITS_MD.get(unit, unit)


def _measured(stats, unit):
    spread = "" if stats["n"] == 1 else (
        f" ({_number(stats['min'])}–{_number(stats['max'])}, n={stats['n']})")
    return f"{_number(stats['median'])} {_unit_md(unit)}{spread}"


def _target_md(target, unit):
    return "report only" if target is None else Target(**target).describe(unit)


def _met_md(target, met):
    if target is None:
        return ""
    if not target["applies"]:
        return "not judged here"
    return "met" if met else "**missed**"


def _ratio_md(anchor):
    if anchor["ratio"] is None:
        return "—"
    inverse = " (anchor / ours)" if anchor["ratio_of"] == "anchor / ours" else ""
    return f"{_number(anchor['ratio'])}×{inverse}"


def _figure_cells(figure):
    return [f"{figure['name']}<br>*{figure['ours']['label']}*",
            _measured(figure["ours"], figure["unit"])]


def _check_cells(figure, anchor):
    """The anchor, ratio, target and verdict cells of one comparison; anchor None: the target on
    our own median."""
    if anchor is None:
        return ["—", "—", _target_md(figure["target"], " " + _unit_md(figure["unit"])),
                _met_md(figure["target"], figure["met"])]
    return [anchor["name"] + ": " + _measured(anchor, figure["unit"]), _ratio_md(anchor),
            _target_md(anchor["target"], "x"), _met_md(anchor["target"], anchor["met"])]


def _rows(figure):
    """Table rows of one figure: one per anchor, then one for a target on our own median (or a
    lone row for a figure with neither)."""
    checks = list(figure["anchors"])
    if figure["target"] is not None or not checks:
        checks.append(None)
    return [(_figure_cells(figure) if i == 0 else ["", ""]) + _check_cells(figure, anchor)
            for i, anchor in enumerate(checks)]


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


FIGURE_HEADER = ["figure (*ours*)", "ours: median (min–max, n)", "anchor: median (min–max, n)",
                 "ratio", "target", ""]


def as_markdown(data, plot):
    m = data["machine"]
    summary = data["summary"]
    lines = [
        "# dtorch_ops benchmark report", "",
        f"Written by `make bench` ({m['mode']} run, {m['duration_s']:g} s) on {m['date']}. Every "
        "number below was measured in this run; each anchor was measured beside ours, cases "
        "interleaved. Medians, with the min–max over the samples (repeats, rounds or single "
        "values, as each benchmark takes them). Ratio: ours / anchor, or anchor / ours where "
        "marked (how many times faster or lower ours is). A target bounds the ratio, or our own "
        "median in a row whose anchor is \"—\"; it comes from the issue named. \"report only\": "
        "no issue set one. \"not judged here\": the issue set it for other conditions (a GPU, "
        "inductor).", "",
        "## Machine", "",
        *_table(["", ""], [
            ["CPU", m["cpu"]],
            ["cores", f"{m['cores']} ({m['cores_usable']} usable by this process)"],
            ["GPU", m["gpu"] or "none"],
            ["torch", m["torch"]], ["Python", m["python"]], ["kernel", m["kernel"]],
            ["commit", m["commit"] or "unknown"], ["date", m["date"]],
            ["run", f"{m['mode']} ({m['duration_s']:g} s)"]]), "",
        "## Targets", "",
        f"{summary['met']} of {summary['targets']} targets that apply here are met.", "",
        *_table(FIGURE_HEADER, [_figure_cells(figure) + _check_cells(figure, anchor)
                                for _, figure, anchor, _ in _judged(data["sections"])]),
    ]
    for section, figures in data["sections"].items():
        rows = [row for figure in figures for row in _rows(figure)]
        lines += ["", f"## {section}", "", *_table(FIGURE_HEADER, rows)]
    if plot:
        lines += ["", f"![latency and bandwidth against tensor size]({plot})"]
    return "\n".join(lines) + "\n"


# ---- the plot ----


def _as_us(value, unit, nbytes):
    """A figure's value as the time to move nbytes, in us (latency is already one)."""
    return value if unit == "us" else nbytes / (value * 1e3)  # GB/s


def _size_label(nbytes):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def _errorbar(ax, sizes, triples, **style):
    """triples: (median, min, max) per size; the bars span min..max."""
    medians = [t[0] for t in triples]
    return ax.errorbar(sizes, medians, yerr=[[t[0] - t[1] for t in triples],
                                             [t[2] - t[0] for t in triples]], **style)


def as_png(report, path, title):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    by_size = {}  # series label -> {bytes: (median, min, max) in us}
    flat = {}  # series label -> median us, of what does not depend on the tensor's size
    ours = set()
    for figure in report.figures:
        if figure.size_bytes is None:
            continue
        ours.add(figure.ours)
        series = [(figure.ours, figure.samples, figure.size_independent)]
        series += [(a.name, a.samples, figure.size_independent or a.size_independent)
                   for a in figure.anchors]
        for label, samples, size_independent in series:
            stats = Stats.of(samples)
            if size_independent:
                flat[label] = stats.median
                continue
            times = sorted(_as_us(v, figure.unit, figure.size_bytes)
                           for v in (stats.median, stats.min, stats.max))
            by_size.setdefault(label, {}).setdefault(
                figure.size_bytes,
                (_as_us(stats.median, figure.unit, figure.size_bytes), times[0], times[-1]))
    fig, (latency_ax, bandwidth_ax) = plt.subplots(1, 2, figsize=(14, 6))
    for label, points in by_size.items():
        sizes = sorted(points)
        style = {"label": label, "marker": "o", "capsize": 3,
                 "linestyle": "-" if label in ours else "--",
                 "linewidth": 2 if label in ours else 1}
        line = _errorbar(latency_ax, sizes, [points[s] for s in sizes], **style)
        # bandwidth = bytes / time: the slowest sample gives the lowest bandwidth
        _errorbar(bandwidth_ax, sizes,
                  [(s / (med * 1e3), s / (slowest * 1e3), s / (fastest * 1e3))
                   for s, (med, fastest, slowest) in ((s, points[s]) for s in sizes)],
                  color=line[0].get_color(), **style)
    for (label, us), style in zip(flat.items(), itertools.cycle(("-", "--", ":", "-."))):
        latency_ax.axhline(us, linestyle=style, linewidth=1, color="black",
                           label=f"{label} (size-independent)")
    sizes = sorted({s for points in by_size.values() for s in points})
    for ax, ylabel in ((latency_ax, "one-way time to the consumer (µs)"),
                       (bandwidth_ax, "bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [_size_label(s) for s in sizes])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.set_xlabel("tensor size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    latency_ax.set_title("latency (median, bars: min–max; flat lines: in-process round trips "
                         "and the pipe's fixed message)", fontsize=9)
    bandwidth_ax.set_title("bandwidth (median, bars: min–max)", fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report, out_dir, quick, seconds):
    """Writes REPORT.json, REPORT.md and REPORT.png into out_dir; returns their paths. Without
    matplotlib (scripts/install_deps.sh installs it; a device machine may lack it) the figures
    still matter more than the plot: the PNG alone is skipped, saying so."""
    os.makedirs(out_dir, exist_ok=True)
    data = as_json(report, quick, seconds)
    plot = "REPORT.png" if importlib.util.find_spec("matplotlib") is not None else None
    paths = [os.path.join(out_dir, name) for name in ("REPORT.json", "REPORT.md")]
    with open(paths[0], "w") as f:
        json.dump(data, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(as_markdown(data, plot))
    if plot is None:
        print("\nmatplotlib is not installed (scripts/install_deps.sh installs it): "
              "REPORT.png not written")
        return paths
    m = data["machine"]
    paths.append(os.path.join(out_dir, plot))
    as_png(report, paths[-1], f"dtorch_ops vs anchors: {m['cpu']}, {m['cores']} cores, torch "
                              f"{m['torch']}, {m['mode']} run, {m['date']}")
    return paths
