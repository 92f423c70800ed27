"""Start-up cost of the ``forge`` command against a bare interpreter and ``import torch``.

Listing plugins and validating configs must stay cheap: plugin modules import no torch, and
``forge list-plugins`` imports no options class (issue 33: at most 0.10x ``import torch``). This
measures it. On a shared machine the load moves every figure: the load average before the run is
kept in the notes, the one after it with the machine. Each command runs in a fresh interpreter;
the commands alternate round by round (after warm-up rounds) so that drifting machine load hits
them alike; medians are reported, with the ratio to the bare interpreter and to ``import torch``.

Run:  .venv/bin/python benchmarks/bench_startup.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from _record import save

FORGE = [sys.executable, "-m", "forge_lm"]
COMMANDS = {
    "python (bare interpreter)": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "forge --help": [*FORGE, "--help"],
    "forge list-plugins": [*FORGE, "list-plugins"],
    "forge list-plugins --json": [*FORGE, "list-plugins", "--json"],
    "forge config validate": [*FORGE, "config", "validate"],
}


def time_once(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    load_before = os.getloadavg()
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for round_index in range(args.warmup + args.rounds):
        for name, command in COMMANDS.items():
            elapsed = time_once(command)
            if round_index >= args.warmup:
                samples[name].append(elapsed)

    bare = statistics.median(samples["python (bare interpreter)"])
    torch_import = statistics.median(samples["python -c 'import torch'"])
    rows = []
    for name, values in samples.items():
        median = statistics.median(values)
        rows.append(
            {
                "command": name,
                "median_s": median,
                "min_s": min(values),
                "x_bare_python": median / bare,
                "x_import_torch": median / torch_import,
            }
        )
        print(f"{name:32s} median {median * 1000:7.1f} ms  ({median / torch_import:.2f}x import torch)")
    by_command = {row["command"]: row for row in rows}
    save(
        "startup",
        f"python benchmarks/bench_startup.py --rounds {args.rounds} --warmup {args.warmup}",
        rows,
        notes=(
            f"Medians of {args.rounds} alternating rounds after {args.warmup} warm-up rounds; wall time per process. "
            f"Load average before the run: {' / '.join(f'{value:.2f}' for value in load_before)} (1/5/15 min)."
        ),
        headline=[
            {
                "measure": "`forge --help` / `python -c 'import torch'` (wall time)",
                "value": by_command["forge --help"]["x_import_torch"],
                "meaning": "below 1: the command imports no torch",
            },
            {
                "measure": "`forge list-plugins` / `python -c 'import torch'` (wall time)",
                "value": by_command["forge list-plugins"]["x_import_torch"],
                "meaning": "the target is at most 0.10 (issue 33)",
            },
        ],
    )


if __name__ == "__main__":
    main()
