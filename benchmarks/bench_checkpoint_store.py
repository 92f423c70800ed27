"""Checkpoints on an object store: save and load time to a local S3-compatible server against the
same checkpoint on the local disk.

The state is the default run's after two training steps (the default model and AdamW's moments),
saved and loaded by ``CheckpointManager`` once into a run directory's ``checkpoints/`` and once
into ``s3://<bucket>/bench`` on moto's S3 server, started here on localhost as a subprocess
(``moto[server]``, a Python server keeping the objects in memory: it measures Forge's and the
client library's overhead, not a real object store's network and disks). The four variants
alternate round by round after warm-up rounds; medians are reported, with each ratio over the
local disk's time for the same operation.

Run:  .venv/bin/python benchmarks/bench_checkpoint_store.py [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from _record import alternate, median, save
from bench_train import ForgeSide

from forge_lm.checkpoint import CheckpointManager
from forge_lm.plugins import PluginSettings


def start_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free localhost port; the process and its endpoint."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return server, endpoint
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit("moto's server did not start (pip install 'moto[server]')") from None
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, no warm-up")
    parser.add_argument("--note", default="", help="said in the record's notes (the machine's load, say)")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write results/checkpoint_store.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup = 2, 0
    if args.threads:
        torch.set_num_threads(args.threads)

    server, endpoint = start_server()
    # The client's settings come from the environment, as a run's do (a throwaway key for moto).
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_ENDPOINT_URL=endpoint,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-checkpoint-store-"))
    try:
        import s3fs

        s3fs.S3FileSystem().mkdir("forge-bench")
        side = ForgeSide(["--train.device=cpu", "--train.precision=fp32"], workdir / "run", PluginSettings.from_env())
        side.run(2)  # AdamW's moments exist after a step: the state a checkpoint really holds
        managers = {
            "local disk": CheckpointManager(workdir / "local", keep_last_n=1),
            "object store": CheckpointManager(workdir / "s3", keep_last_n=1, location="s3://forge-bench/bench"),
        }
        saves = dict.fromkeys(managers, 0)

        def saving(where: str) -> float:
            saves[where] += 1  # a new step each time; keep_last_n = 1 prunes the previous one
            begin = time.perf_counter()
            managers[where].save(saves[where], side.model, side.optimizer, {})
            return time.perf_counter() - begin

        def loading(where: str) -> float:
            begin = time.perf_counter()
            managers[where].load(side.model, side.optimizer)
            return time.perf_counter() - begin

        variants = {}
        for where in managers:
            variants[f"save, {where}"] = lambda where=where: saving(where)
            variants[f"load, {where}"] = lambda where=where: loading(where)
        started = time.perf_counter()

        def progress(index: int) -> None:
            print(f"  round {index + 1}/{args.warmup + args.rounds} done, {time.perf_counter() - started:.0f} s")

        samples = alternate(variants, args.rounds, args.warmup, progress)
        size = sum(f.stat().st_size for f in managers["local disk"].latest().iterdir())
        parameters = sum(p.numel() for p in side.model.parameters())
        side.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)

    rows = []
    for name, values in samples.items():
        operation = name.partition(",")[0]
        local = median(samples[f"{operation}, local disk"])
        value = median(values)
        rows.append(
            {"what": name, "median_ms": value * 1000, "min_ms": min(values) * 1000, "x_local_disk": value / local}
        )
        print(f"{name:22s} {value * 1000:9.1f} ms  x{value / local:.2f} of the local disk")
    notes = (
        f"The default model ({parameters / 1e6:.2f} M parameters) with AdamW state: {size / 1e6:.1f} MB per "
        "checkpoint, saved and loaded by CheckpointManager into <run>/checkpoints and into s3://forge-bench/bench "
        "on moto's S3 server on localhost (a Python server holding objects in memory: Forge's and s3fs's "
        f"overhead, not a real store's network). Medians of {args.rounds} alternating rounds after {args.warmup} "
        "warm-up round(s). " + args.note
    ).strip()
    headline = [
        {
            "measure": "checkpoint save to a local S3 server (moto) / to the local disk (default model + AdamW)",
            "value": median(samples["save, object store"]) / median(samples["save, local disk"]),
            "meaning": "what keeping checkpoints on an object store costs a synchronous save, before any network",
        }
    ]
    if not args.no_save:
        command = ("python benchmarks/bench_checkpoint_store.py " + " ".join(sys.argv[1:])).strip()
        print(f"wrote {save('checkpoint_store', command, rows, notes, headline=headline)}")


if __name__ == "__main__":
    main()
