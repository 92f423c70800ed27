"""``forge profile RUN_DIR [--rank R] [--top N] [--output PNG]``: the operators that took the
most time in a run's profiled steps, as a table and a bar chart.

Reads what ``[profiling] enabled = true`` wrote (see ``forge_lm.train.profiling``): for each
window of ``profiles/rank<R>/``, the operator summary ``ops_step<a>-<b>.json`` or, where that
is missing, the Chrome trace ``trace_step<a>-<b>.json[.gz]`` beside it. Every window of the
rank is summed: a run profiled over several windows is shown as one total.

The files are read as untrusted input (a run directory may come from elsewhere): a damaged
file is an error that names it, and nothing that links outside the run directory is opened.
This module imports neither torch nor matplotlib at the top; matplotlib only to draw.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
import zlib
from pathlib import Path
from typing import Any

from forge_lm.errors import PluginError, UsageError

HELP = "show the operators that took the most time in a run's profiled steps, and chart them into a PNG"
EPILOG = (
    "Profiles are written by training with `[profiling] enabled = true` (or --profiling.enabled=true), "
    "one folder per rank under RUN_DIR/profiles. All windows of the rank are summed. Times are self times "
    "(an operator's own, without the operators it called), in milliseconds; on CUDA, device time is the "
    "kernels' time, charged both to each kernel and to the operator that launched it."
)
TAKES_OVERRIDES = False

INSTALL_HINT = "pip install forge-lm[plot]"
PROFILES_DIR = "profiles"  # as forge_lm.train.profiling writes them
DEFAULT_TOP = 15
DPI = 120
MAX_LABEL = 60  # characters of an operator's name on the chart's axis
MAX_TRACE_BYTES = 2**30  # the most a .json.gz trace may decompress to; a larger one is refused as damaged

_RANK_DIR = re.compile(r"rank(\d+)")
_WINDOW_FILE = re.compile(r"(ops|trace)_step(\d+)-(\d+)\.json(\.gz)?")
# Spans that wrap whole steps: not operators (as in the summaries the profiler writes).
_STEP_SPANS = ("ProfilerStep", "forge/step_")
_CPU_CATEGORIES = ("cpu_op", "user_annotation")
# Python frames (recorded with with_stack) are not operators, but torch counts the time of one
# inside an operator as not the operator's own: they take part in the nesting, unreported.
_PYTHON_CATEGORY = "python_function"
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def add_arguments(parser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory of a profiled run")
    parser.add_argument(
        "--rank", type=int, default=None, metavar="R", help="whose profiles to read (default: 0, else the lowest rank)"
    )
    parser.add_argument(
        "--top", type=int, default=DEFAULT_TOP, metavar="N", help=f"operators to show (default: {DEFAULT_TOP})"
    )
    parser.add_argument(
        "--sort",
        choices=["cpu", "device"],
        default=None,
        help="rank operators by self CPU or device time (default: device time when there is any, else CPU)",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="PNG",
        default=None,
        help="chart to write (default: RUN_DIR/profiles/top_ops.png)",
    )


def run(args, overrides, plugins) -> int:
    # Reading files needs no plugins, so `plugins` is never called.
    if args.top < 1:
        raise UsageError(f"--top must be 1 or more, got {args.top}.")
    notes: list[str] = []
    try:
        profile = load_profile(args.run_dir, args.rank, notes)
    finally:  # the files passed over explain a "no profiles" error too
        for note in notes:
            print(f"forge: note: {note}", file=sys.stderr)
    sort = args.sort or ("device" if profile.has_device else "cpu")
    if sort == "device" and not profile.has_device:
        raise UsageError(f"rank {profile.rank}'s profiles hold no device times (a CPU run?); use --sort cpu.")
    top = profile.top(sort, args.top)
    print(format_table(profile, top, sort))
    output = Path(args.output) if args.output else Path(args.run_dir) / PROFILES_DIR / "top_ops.png"
    draw_chart(profile, top, sort, output)
    print(f"wrote {output}")
    return 0


class Profile:
    """The summed operators of one rank's windows."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.windows: list[tuple[int, int]] = []
        self.device: str | None = None
        self.has_device = False
        self.self_cpu_total = 0.0
        self.self_device_total = 0.0
        # (name, is a kernel) -> [calls, self CPU us, self device us]
        self.ops: dict[tuple[str, bool], list[float]] = {}

    def add(self, name: str, kernel: bool, calls: int, self_cpu: float, self_device: float) -> None:
        row = self.ops.setdefault((name, kernel), [0, 0.0, 0.0])
        row[0] += calls
        row[1] += self_cpu
        row[2] += self_device

    def top(self, sort: str, n: int) -> list[tuple[str, int, float, float]]:
        """The ``n`` rows with the most self time of ``sort``: (name, calls, self CPU us, self device us)."""
        column = 1 if sort == "cpu" else 2
        rows = [(name, int(v[0]), v[1], v[2]) for (name, _), v in self.ops.items() if v[column] > 0]
        # Ties (common among microsecond timings) fall back to the name, so output is stable.
        rows.sort(key=lambda row: (-row[column + 1], row[0]))
        return rows[:n]

    def describe_windows(self) -> str:
        spans = [f"{a}-{b}" if a != b else f"{a}" for a, b in self.windows]
        if len(spans) == 1:
            return f"steps {spans[0]}"
        if len(spans) > 4:
            return f"{len(spans)} windows summed (steps {spans[0]} to {spans[-1]})"
        return f"{len(spans)} windows summed (steps {', '.join(spans)})"


def load_profile(run_dir: str | Path, rank: int | None = None, notes: list[str] | None = None) -> Profile:
    """The operators of ``rank`` (default: 0, else the lowest rank with profiles) in ``run_dir``."""
    notes = notes if notes is not None else []
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"no run directory at '{run_dir}'.")
    root = run_dir.resolve()
    try:
        ranks = _ranks(run_dir, root, notes)
    except OSError as exc:  # a folder that cannot be listed
        raise UsageError(f"cannot read '{exc.filename or run_dir}': {exc.strerror or exc}.") from None
    if not ranks:
        raise UsageError(
            f"'{run_dir}' holds no profiles (looked in '{run_dir / PROFILES_DIR}'). Train it with "
            "`[profiling] enabled = true` in its config (or --profiling.enabled=true on the command line); "
            "[profiling] start_step, warmup_steps and active_steps choose the steps profiled."
        )
    if rank is None:
        rank = 0 if 0 in ranks else min(ranks)
    elif rank not in ranks:
        have = ", ".join(str(r) for r in sorted(ranks))
        raise UsageError(f"rank {rank} has no profiles in '{run_dir / PROFILES_DIR}'; ranks with profiles: {have}.")
    profile = Profile(run_dir, rank)
    for steps, files in sorted(ranks[rank].items()):
        if "ops" in files:
            _read_summary(files["ops"], profile)
        else:
            _read_trace(files["trace"], profile)
        profile.windows.append(steps)
    return profile


def _ranks(run_dir: Path, root: Path, notes: list[str]) -> dict[int, dict[tuple[int, int], dict[str, Path]]]:
    """rank -> (first step, last step) -> {"ops" or "trace": file}, for the ranks with any window."""
    profiles = run_dir / PROFILES_DIR
    found: dict[int, dict[tuple[int, int], dict[str, Path]]] = {}
    if not profiles.is_dir() or not _inside(profiles, root, notes):
        return found
    for rank_dir in profiles.iterdir():
        match = _RANK_DIR.fullmatch(rank_dir.name)
        if not match or not rank_dir.is_dir() or not _inside(rank_dir, root, notes):
            continue
        windows: dict[tuple[int, int], dict[str, Path]] = {}
        for path in rank_dir.iterdir():
            file = _WINDOW_FILE.fullmatch(path.name)
            if not file or not path.is_file() or not _inside(path, root, notes):
                continue
            kind, steps = file.group(1), (int(file.group(2)), int(file.group(3)))
            # One trace per window: the plain one when both a .json and a .json.gz exist.
            if kind not in windows.get(steps, {}) or not file.group(4):
                windows.setdefault(steps, {})[kind] = path
        if windows:
            found[int(match.group(1))] = windows
    return found


def _inside(path: Path, root: Path, notes: list[str]) -> bool:
    """Whether ``path``, links followed, stays in the run directory (else it is skipped, with a note)."""
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError, RuntimeError):  # OSError, RuntimeError (before Python 3.13): a link loop
        notes.append(f"skipped '{path}': it links outside the run directory")
        return False
    return True


def _read_summary(path: Path, profile: Profile) -> None:
    data = _load_json(path)
    ops = data.get("ops") if isinstance(data, dict) else None
    if not isinstance(ops, list):
        raise _damaged(path, "it has no list of operators ('ops')")
    device = data.get("device")
    if isinstance(device, str):
        profile.device = device
    if "self_device_us_total" in data:
        profile.has_device = True
        profile.self_device_total += _number(data, "self_device_us_total", path)
    profile.self_cpu_total += _number(data, "self_cpu_us_total", path)
    for op in ops:
        if not isinstance(op, dict) or not isinstance(op.get("name"), str):
            raise _damaged(path, "an operator has no name")
        calls = _number(op, "calls", path)
        device_us = _number(op, "self_device_us", path) if "self_device_us" in op else 0.0
        profile.add(op["name"], op.get("kernel") is True, int(calls), _number(op, "self_cpu_us", path), device_us)


def _read_trace(path: Path, profile: Profile) -> None:
    """Self times from the Chrome trace alone (no summary beside it).

    An operator's self time is its duration less that of the operators directly inside it,
    on the same thread. Device time is each kernel's (or copy's) duration, under the kernel's
    own name: linking kernels to the operators that launched them is what the summary adds.
    """
    data = _load_json(path)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise _damaged(path, "it has no list of trace events ('traceEvents')")
    threads: dict[tuple[str, str], list[tuple[float, float, str, bool]]] = {}
    cpu_total = device_total = 0.0
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue  # metadata, flows, counters: not timed operators
        name, ts, dur = event.get("name"), event.get("ts"), event.get("dur")
        if not isinstance(name, str) or not _finite(ts) or not _finite(dur) or dur < 0:
            continue
        category = event.get("cat")
        if category in _CPU_CATEGORIES or category == _PYTHON_CATEGORY:
            span = (float(ts), float(dur), name, category == _PYTHON_CATEGORY)
            threads.setdefault((str(event.get("pid")), str(event.get("tid"))), []).append(span)
        elif category in _DEVICE_CATEGORIES:
            profile.has_device = True
            profile.add(name, True, 1, 0.0, float(dur))
            device_total += float(dur)
    for spans in threads.values():
        spans.sort(key=lambda span: (span[0], -span[1]))  # a parent before the children it starts with
        stack: list[list[Any]] = []  # [end, self time so far, name, is a Python frame]
        for ts, dur, name, frame in spans:
            # As torch nests them: a span that ends after the open one is not inside it.
            while stack and (stack[-1][0] <= ts or ts + dur > stack[-1][0]):
                cpu_total += _close(stack.pop(), profile)
            if stack:
                stack[-1][1] -= dur
            stack.append([ts + dur, dur, name, frame])
        while stack:
            cpu_total += _close(stack.pop(), profile)
    profile.self_cpu_total += cpu_total
    profile.self_device_total += device_total
    if profile.device is None:
        profile.device = "cuda" if profile.has_device else "cpu"


def _close(span: list[Any], profile: Profile) -> float:
    _end, self_time, name, frame = span
    if frame or name.startswith(_STEP_SPANS):
        return 0.0
    profile.add(name, False, 1, self_time, 0.0)
    return self_time


def _load_json(path: Path) -> Any:
    try:
        if path.suffix == ".gz":
            # Read through a cap: a few kilobytes of gzip can expand to more than this host's memory.
            with gzip.open(path, "rb") as stream:
                raw = stream.read(MAX_TRACE_BYTES + 1)
            if len(raw) > MAX_TRACE_BYTES:
                raise _damaged(
                    path,
                    f"it decompresses to more than {MAX_TRACE_BYTES / 2**30:g} GiB, more than a profiled window's "
                    "trace holds",
                )
        else:
            raw = path.read_bytes()
        return json.loads(raw)
    except OSError as exc:
        if isinstance(exc, gzip.BadGzipFile):
            raise _damaged(path, f"it is not gzip data ({exc})") from None
        raise UsageError(f"cannot read '{path}': {exc.strerror or exc}.") from None
    except (EOFError, zlib.error) as exc:
        raise _damaged(path, f"its gzip data is cut short or corrupt ({exc})") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise _damaged(path, f"it is not valid JSON ({exc})") from None


def _number(record: dict, key: str, path: Path) -> float:
    value = record.get(key)
    if not _finite(value):
        raise _damaged(path, f"'{key}' is {value!r}, not a finite number")
    return float(value)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _damaged(path: Path, why: str) -> UsageError:
    return UsageError(f"'{path}' is damaged: {why}. Delete it (and profile again) to read the rank's other windows.")


def format_table(profile: Profile, top: list[tuple[str, int, float, float]], sort: str) -> str:
    """The top operators as aligned text, with their share of the rank's total self time."""
    what = "self device time" if sort == "device" else "self CPU time"
    device = f" on {profile.device}" if profile.device else ""
    lines = [f"rank {profile.rank}{device}, {profile.describe_windows()}: top {len(top)} operators by {what}"]
    header = ["#", "self CPU ms", "CPU %"]
    if profile.has_device:
        header += ["self device ms", "device %"]
    header += ["calls", "operator"]
    rows = []
    for index, (name, calls, cpu, dev) in enumerate(top, start=1):
        row = [str(index), f"{cpu / 1000:.3f}", _share(cpu, profile.self_cpu_total)]
        if profile.has_device:
            row += [f"{dev / 1000:.3f}", _share(dev, profile.self_device_total)]
        rows.append([*row, str(calls), name])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [cell.rjust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]))
    return "\n".join(lines)


def _share(part: float, total: float) -> str:
    return f"{100 * part / total:.1f}%" if total > 0 else "-"


def draw_chart(profile: Profile, top: list[tuple[str, int, float, float]], sort: str, output: Path) -> Path:
    """A horizontal bar per operator (CPU and, when there is any, device self time), largest on top."""
    figure_class, canvas_class = _matplotlib()
    figure = figure_class(figsize=(10, 1.5 + 0.35 * len(top)), layout="constrained")
    canvas_class(figure)  # attaches itself to the figure: savefig then renders with Agg, no pyplot
    ax = figure.subplots()
    labels = [name if len(name) <= MAX_LABEL else name[: MAX_LABEL - 1] + "…" for name, *_ in top]
    positions = list(range(len(top)))
    series = [("self CPU", [cpu / 1000 for _, _, cpu, _ in top])]
    if profile.has_device:
        series.append(("self device", [dev / 1000 for _, _, _, dev in top]))
        if sort == "device":
            series.reverse()  # the ranking's measure first
    height = 0.8 / len(series)
    for index, (label, values) in enumerate(series):
        offsets = [p - 0.4 + height * (index + 0.5) for p in positions]
        ax.barh(offsets, values, height=height, label=label, color=f"C{index}")
    ax.set_yticks(positions, labels)
    ax.invert_yaxis()  # the largest at the top, as in the table
    ax.set_xlabel("self time (ms)")
    ax.grid(axis="x", alpha=0.3)
    if len(series) > 1:
        ax.legend(loc="lower right")
    ax.set_title(f"{profile.run_dir.name}: rank {profile.rank}, {profile.describe_windows()}", loc="left")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(output, dpi=DPI)  # the format follows the suffix
    except OSError as exc:
        raise UsageError(f"cannot write '{output}': {exc.strerror or exc}.") from None
    except ValueError as exc:  # matplotlib's answer to a suffix it has no writer for
        raise UsageError(f"cannot write '{output}': {exc} Use a .png output.") from None
    return output


def _matplotlib() -> tuple[type, type]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PluginError(
            f"charting needs matplotlib, which is not installed. Install it with `{INSTALL_HINT}`."
        ) from None
    return Figure, FigureCanvasAgg
