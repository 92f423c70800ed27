"""Shared by the benchmarks: describe the machine, save a result, rebuild RESULTS.md.

Each benchmark writes ``results/<name>.json``; ``RESULTS.md`` is regenerated from all of them,
so it always shows the latest recorded run of every benchmark with its machine and command.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def machine() -> dict[str, Any]:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import importlib.metadata

        info["torch"] = importlib.metadata.version("torch")
    except Exception:  # noqa: BLE001 - the description is best-effort
        info["torch"] = "not installed"
    return info


def save(name: str, command: str, rows: list[dict[str, Any]], notes: str = "") -> Path:
    RESULTS.mkdir(exist_ok=True)
    record = {
        "benchmark": name,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "notes": notes,
        "rows": rows,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    write_results_md()
    return path


def write_results_md() -> None:
    lines = ["# Benchmark results", "", "Regenerated from `benchmarks/results/*.json` by each benchmark run.", ""]
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        m = record["machine"]
        lines += [
            f"## {record['benchmark']}",
            "",
            f"`{record['command']}`, {record['date']}, on {m['cpus']} CPUs ({m['processor']}), "
            f"Python {m['python']}, torch {m['torch']}, {m['platform']}.",
            "",
        ]
        if record["notes"]:
            lines += [record["notes"], ""]
        columns = list(record["rows"][0])
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for row in record["rows"]:
            lines.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
        lines.append("")
    (HERE / "RESULTS.md").write_text("\n".join(lines))


def _cell(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(write_results_md())
