"""Run every CPU benchmark in turn and refresh RESULTS.md: the one command behind ``make bench``.

Runs, each in a fresh interpreter with the arguments below (sized so that the whole run
stays under 15 minutes on a 2-core CPU): start-up (``bench_startup.py``), training
throughput (``bench_train.py``), the loop's fixed cost per step part by part
(``bench_overhead.py``), data loading (``bench_data.py``), checkpoint saving
(``bench_checkpoint.py``), and, when their scripts exist, the Muon optimizer step
(``bench_muon.py``) and the MoE layer (``bench_moe.py``), then the throughput regression check
(``check_train_ratio.py``, failing below 0.95x the plain loop); a missing script is skipped
with a note. ``--gpu`` runs ``bench_gpu.py`` alone instead (it needs CUDA, and a GPU session has no
time for the CPU benchmarks). Each benchmark writes its ``results/<name>.json`` and regenerates
``RESULTS.md``; at the end the headline ratios are printed. Timings are only meaningful on an
otherwise idle machine: the load average is checked first, and recorded with every result.

Run:  .venv/bin/python benchmarks/run_all.py [--quick] [--only train data] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _record import HERE, RESULTS, headlines, write_results_md

# (script, its arguments in the full run, in a --quick run): sized for < 15 minutes in all.
BENCHMARKS: list[tuple[str, list[str], list[str]]] = [
    ("bench_startup.py", ["--rounds", "10"], ["--rounds", "2", "--warmup", "1"]),
    ("bench_train.py", ["--rounds", "3", "--steps", "10", "--compile"], ["--quick"]),
    (
        "bench_overhead.py",
        ["--steps", "300", "--rounds", "5", "--pairs", "120"],
        ["--steps", "30", "--rounds", "1", "--pairs", "8"],
    ),
    ("bench_data.py", ["--rounds", "5"], ["--quick"]),
    ("bench_checkpoint.py", ["--rounds", "5"], ["--quick"]),
    ("bench_muon.py", ["--rounds", "3"], ["--rounds", "2", "--warmup", "1"]),
    ("bench_moe.py", ["--rounds", "5"], ["--rounds", "2", "--warmup", "1"]),
    # the throughput regression check (exit 1 below 0.95x the plain loop), last: on the idlest machine
    ("check_train_ratio.py", ["--rounds", "5"], ["--rounds", "1", "--steps", "1"]),
]
GPU = ("bench_gpu.py", [], ["--rounds", "2", "--steps", "3", "--no-moe"])
BUDGET_S = 15 * 60


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke runs: check that every script runs end to end")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these benchmarks (e.g. train data)")
    parser.add_argument("--gpu", action="store_true", help="run only bench_gpu.py (needs CUDA), no CPU benchmark")
    args = parser.parse_args()

    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * cpus:
        print(
            f"run_all: warning: the load average is {load:.1f} on {cpus} CPUs; other work distorts every timing "
            "(it is recorded with each result). Run on an idle machine for numbers to quote.",
            file=sys.stderr,
            flush=True,
        )
    chosen = [GPU] if args.gpu else list(BENCHMARKS)
    if args.only:
        wanted = {name.removeprefix("bench_").removesuffix(".py") for name in args.only}
        chosen = [b for b in chosen if b[0].removeprefix("bench_").removesuffix(".py") in wanted]

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    summary = []
    started = time.perf_counter()
    for script, full, quick in chosen:
        path = HERE / script
        if not path.exists():
            print(f"\n== {script}: not present, skipped", flush=True)
            summary.append((script, "skipped (not present)", 0.0))
            continue
        command = [sys.executable, str(path), *(quick if args.quick else full)]
        print(f"\n== {script} {' '.join(command[2:])}", flush=True)
        begin = time.perf_counter()
        code = subprocess.run(command, cwd=HERE.parent, env=env, check=False).returncode
        elapsed = time.perf_counter() - begin
        status = "ok" if code == 0 else f"failed (exit {code})"
        summary.append((script, status, elapsed))

    total = time.perf_counter() - started
    write_results_md()
    print("\n== summary")
    for script, status, elapsed in summary:
        print(f"  {script:22s} {status:22s} {elapsed:6.0f} s")
    print(f"  {'total':22s} {'':22s} {total:6.0f} s" + ("  (over the 15-minute budget)" if total > BUDGET_S else ""))
    print("\n== headline ratios (RESULTS.md)")
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        for item in headlines(record):
            print(f"  {record['benchmark']:12s} {item['value']:8.3g}  {item['measure']}")
    print(f"\nwrote {Path(HERE / 'RESULTS.md')}")
    return 0 if all(status in ("ok", "skipped (not present)") for _, status, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
