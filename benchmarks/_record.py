"""Shared by the benchmarks: describe the machine, time alternating work, save a result, rebuild RESULTS.md.

Each benchmark writes ``results/<name>.json``; ``RESULTS.md`` is regenerated from all of them,
so it always shows the latest recorded run of every benchmark with its machine and command.
Its first section, "Headline ratios", gathers the key ratio of each benchmark in one table
(a benchmark names its own with ``save(..., headline=[...])``; :data:`DERIVED_HEADLINES`
derives one for records written without).

``python benchmarks/_record.py`` only regenerates ``RESULTS.md`` from the JSON files.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# The CPU flags that decide which matrix-product kernels are fastest (two hosts of the same name can
# differ): forge_lm.hardware.MATRIX_FLAGS, repeated here so that describing the machine imports no
# torch (a test keeps the two equal).
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key = line.split(":", 1)[0].strip().lower()
            if key == "model name" and "cpu_model" not in info:
                info["cpu_model"] = line.split(":", 1)[1].strip()
            elif key == "flags" and "cpu_flags" not in info:  # what decides the fastest kernels here
                present = set(line.split(":", 1)[1].split())
                info["cpu_flags"] = [flag for flag in MATMUL_FLAGS if flag in present]
    with contextlib.suppress(OSError, AttributeError):
        info["load_average"] = [round(value, 2) for value in os.getloadavg()]  # a busy machine shows here
    info["kernel_rates"] = kernel_rates(info.get("cpu_model"), info.get("cpu_flags"))
    try:
        import importlib.metadata

        info["torch"] = importlib.metadata.version("torch")
    except Exception:  # noqa: BLE001 - the description is best-effort
        info["torch"] = "not installed"
    if "torch" in sys.modules:  # only when the benchmark imported it: describing must not cost an import
        torch = sys.modules["torch"]
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def kernel_rates(cpu_model: str | None, flags: list[str] | None) -> list[dict[str, Any]]:
    """What Forge measured on this host (same CPU model and matrix flags) and cached, read from
    its caches (``$XDG_CACHE_HOME/forge_lm``, as :func:`forge_lm.hardware.cache_dir`): each
    dtype's peak matmul rate and each fp32 model's oneDNN-over-torch ratio behind ``auto``'s
    kernel choice. Only idle measurements are cached, so these are rates of this host, not of
    the run's load; a record without them (a fresh host) measured none yet. Nothing is timed."""
    if cpu_model is None or flags is None:
        return []
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "forge_lm"
    prefix = f"{cpu_model} | {'+'.join(flags) or 'no matrix flags known'} | "
    rates: list[dict[str, Any]] = []
    for key, entry in sorted(_read_json(root / "peak_flops.json").items()):
        if key.startswith(prefix) and isinstance(entry, dict) and isinstance(entry.get("flops"), int | float):
            # key: HOST | threads=N | torch=V | DTYPE | KERNELS
            threads, torch_version, dtype, kernels = (part.strip() for part in key[len(prefix) :].split("|")[:4])
            rates.append(
                {
                    "what": f"{dtype} peak ({kernels})",
                    "gflop_per_s": round(entry["flops"] / 1e9, 1),
                    "where": f"{threads}, {torch_version}",
                    "date": entry.get("date"),
                }
            )
    for key, entry in sorted(_read_json(root / "linear_kernel.json").items()):
        if key.startswith(prefix) and isinstance(entry, dict) and _positive(entry, "onednn_s", "aten_s"):
            threads, torch_version, shapes = (part.strip() for part in key[len(prefix) :].split("|", 2))
            rates.append(
                {
                    "what": f"fp32 linear products {shapes}: oneDNN / torch's speed",
                    "ratio": round(entry["aten_s"] / entry["onednn_s"], 3),
                    "where": f"{threads}, {torch_version}",
                    "date": entry.get("date"),
                }
            )
    return rates


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _positive(entry: dict[str, Any], *keys: str) -> bool:
    return all(isinstance(entry.get(k), int | float) and entry[k] > 0 for k in keys)


def alternate(
    variants: dict[str, Callable[[], float]],
    rounds: int,
    warmup: int,
    on_round: Callable[[int], None] | None = None,
    *,
    rotate: bool = False,
) -> dict[str, list[float]]:
    """Run each variant once per round, in turn, ``warmup + rounds`` times; the samples after warm-up.

    A variant returns its own measurement (seconds, or any number); alternating round by round
    makes a drifting machine load hit every variant alike. ``rotate``: round ``r`` starts at
    the ``r``-th variant, so that none always runs first or right after the same neighbour.
    ``on_round(r)`` is called after each round (progress).
    """
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(warmup + rounds):
        shift = round_index % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            value = variants[name]()
            if round_index >= warmup:
                samples[name].append(value)
        if on_round is not None:
            on_round(round_index)
    return samples


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def timed(function: Callable[[], Any]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def make_record(
    name: str,
    command: str,
    rows: list[dict[str, Any]],
    notes: str = "",
    *,
    tables: dict[str, list[dict[str, Any]]] | None = None,
    headline: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The record ``save`` writes to ``results/<name>.json``: the rows with when, where and how.

    ``tables``: further tables, titled by their keys, shown after ``rows``. ``headline``: the
    benchmark's key ratios for RESULTS.md's first table, each ``{"measure": str, "value":
    float, "meaning": str}``.
    """
    record: dict[str, Any] = {
        "benchmark": name,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "notes": notes,
        "rows": rows,
    }
    if tables:
        record["tables"] = tables
    if headline:
        record["headline"] = headline
    return record


def save(
    name: str,
    command: str,
    rows: list[dict[str, Any]],
    notes: str = "",
    *,
    tables: dict[str, list[dict[str, Any]]] | None = None,
    headline: list[dict[str, Any]] | None = None,
) -> Path:
    """Write ``results/<name>.json`` (:func:`make_record`) and regenerate ``RESULTS.md``."""
    RESULTS.mkdir(exist_ok=True)
    record = make_record(name, command, rows, notes, tables=tables, headline=headline)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    write_results_md()
    return path


def _startup_headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for row in record["rows"]:
        if row.get("command") in ("forge --help", "forge list-plugins"):
            found.append(
                {
                    "measure": f"`{row['command']}` / `python -c 'import torch'` (wall time)",
                    "value": row["x_import_torch"],
                    "meaning": "below 1: the command imports no torch",
                }
            )
    return found


# Headlines of records whose script does not name one.
DERIVED_HEADLINES: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {"startup": _startup_headline}


def headlines(record: dict[str, Any]) -> list[dict[str, Any]]:
    if record.get("headline"):
        return record["headline"]
    derive = DERIVED_HEADLINES.get(record["benchmark"])
    try:
        return derive(record) if derive else []
    except (KeyError, TypeError):  # a record of another shape: no headline rather than no RESULTS.md
        return []


def write_results_md() -> None:
    records = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))]
    lines = [
        "# Benchmark results",
        "",
        "Regenerated from `benchmarks/results/*.json` by each benchmark run "
        "(`python benchmarks/run_all.py` reruns all of them). Every number is a median of "
        "alternating repetitions against the named baseline in the same process run; see each "
        "section for the machine, the command and the load average when it ran.",
        "",
    ]
    usual = _usual_host(records)
    headline_rows = [(record, item) for record in records for item in headlines(record)]
    if headline_rows:
        lines += ["## Headline ratios", "", "| benchmark | measure | value | meaning |", "|---|---|---|---|"]
        for record, item in headline_rows:
            elsewhere = f" (on {host_of(record)})" if usual is not None and host_of(record) != usual else ""
            lines.append(
                f"| [{record['benchmark']}](#{record['benchmark']}){elsewhere} | {item['measure']} | "
                f"{_cell(item['value'])} | {item.get('meaning', '')} |"
            )
        lines.append("")
    if usual is not None:
        lines += [
            f"Most sections ran on {usual}; a section measured on another host says so, as does its benchmark's "
            "name in the table above.",
            "",
        ]
    lines += _hosts_section(records)
    for record in records:
        host = host_of(record)
        section = record_markdown(record)
        if usual is not None and host != usual:  # never mixed silently with the others' numbers
            section[1:1] = ["", f"**Measured on another host than the rest of this file: {host}.**"]
        lines += section
    (HERE / "RESULTS.md").write_text("\n".join(lines))


def host_of(record: dict[str, Any]) -> str:
    """A record's host as RESULTS.md names it: the CPU model, its CPU count and its matmul flags."""
    m = record["machine"]
    flags = m.get("cpu_flags")
    described = f"{m.get('cpu_model') or m['processor']}, {m['cpus']} CPUs"
    return described + (f" ({' '.join(flags) or 'no AVX2'})" if flags is not None else "")


def _usual_host(records: list[dict[str, Any]]) -> str | None:
    hosts = [host_of(record) for record in records]
    return max(sorted(set(hosts)), key=hosts.count) if hosts else None


def record_markdown(record: dict[str, Any], heading: str = "##") -> list[str]:
    """One benchmark's section: a heading, what ran where (machine, threads, load), its notes
    and every table."""
    m = record["machine"]
    cpu = m.get("cpu_model") or m["processor"]
    if m.get("cpu_flags") is not None:
        cpu += f"; {' '.join(m['cpu_flags']) or 'no AVX2'}"
    extra = ""
    if m.get("torch_threads"):
        extra += f", {m['torch_threads']} torch thread" + ("s" if m["torch_threads"] != 1 else "")
    if m.get("gpu"):
        extra += f", GPU {m['gpu']}"
    if m.get("load_average"):
        extra += f", load average {' / '.join(str(v) for v in m['load_average'])} (1/5/15 min) at the end"
    lines = [
        f"{heading} {record['benchmark']}",
        "",
        f"`{record['command']}`, {record['date']}, on {m['cpus']} CPUs ({cpu}){extra}, "
        f"Python {m['python']}, torch {m['torch']}, {m['platform']}.",
        "",
    ]
    if record["notes"]:
        lines += [record["notes"], ""]
    lines += _table(record["rows"])
    for title, rows in (record.get("tables") or {}).items():
        lines += [f"**{title}**", "", *_table(rows)]
    return lines


def _hosts_section(records: list[dict[str, Any]]) -> list[str]:
    """What Forge measured on each host of these records and cached there (the newest record of
    each host that carries kernel rates): the figures that tell two hosts of one name apart."""
    newest: dict[str, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: r.get("date", "")):
        if record["machine"].get("kernel_rates"):
            newest[host_of(record)] = record
    if not newest:
        return []
    lines = ["## Hosts", ""]
    for host, record in newest.items():
        rates = record["machine"]["kernel_rates"]
        lines += [
            f"**{host}**, measured by Forge when idle and cached there (as of {record['date']}): "
            + "; ".join(_rate_text(rate) for rate in rates)
            + ".",
            "",
        ]
    return lines


def _rate_text(rate: dict[str, Any]) -> str:
    value = f"{rate['gflop_per_s']} GFLOP/s" if "gflop_per_s" in rate else f"{rate.get('ratio')}x"
    return f"{rate.get('what')} {value} ({rate.get('where')}, {rate.get('date')})"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(no rows)", ""]
    columns = list(rows[0])
    for row in rows[1:]:  # rows may add columns; keep the first row's order
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return [*lines, ""]


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        # Ratios near 1 keep three decimals (1.003 is not 1), large numbers every digit, others three significant ones.
        if abs(value) >= 1000:
            return f"{value:.0f}"
        return f"{value:.3f}" if 0.1 <= abs(value) < 10 else f"{value:.3g}"
    return str(value)


if __name__ == "__main__":
    sys.exit(write_results_md())
