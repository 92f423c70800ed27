"""Bytes each rank hands to the gradient reduction per step, and the step time, on 2 gloo ranks:
``[distributed] reduce_dtype`` fp32 and bf16, and ``[distributed.compression]`` PowerSGD.

The two ranks are replicas (``dp_replicate = 2, dp_shard = 1``), so every gradient crosses
between them. Every collective torch.distributed runs is counted (the module's functions are
wrapped: FSDP2 and the compression hook call them through it) while ``backward()`` runs, which is
where the gradient reduction happens: the bytes of the tensors handed to each collective, and
what a ring algorithm sends per rank for them (all-reduce 2 (n - 1) / n of the tensor,
reduce-scatter and all-gather (n - 1) / n of the whole). Bytes depend on the model and the
settings only; times depend on the machine and its load (indicative here).

Run:  .venv/bin/python benchmarks/bench_reduce.py [--steps 5] [--dim 256]
(it launches itself under torchrun on 2 CPU processes.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "fp32 (HSDP all-reduce)": [],
    "bf16 (reduce_dtype = bf16)": ["--distributed.reduce_dtype=bf16"],
    "powersgd rank 4 (fp32)": [
        "--distributed.compression.method=powersgd",
        "--distributed.compression.rank=4",
        "--distributed.compression.warmup_steps=0",
    ],
}
WRAPPED = {  # function: (kind, ring factor of the tensor's bytes for n ranks)
    "all_reduce": ("all-reduce", lambda n: 2 * (n - 1) / n),
    "reduce_scatter_tensor": ("reduce-scatter", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("reduce-scatter", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("all-gather", lambda n: (n - 1) / n),
    "all_gather_single": ("all-gather", lambda n: (n - 1) / n),
}


class Counter:
    """Wraps torch.distributed's collectives; counts what they are handed while ``on``."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.on, self.calls, self.handed, self.ring = False, 0, 0, 0.0
        for name, (_, factor) in WRAPPED.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, factor, dist))

    def _wrap(self, original, factor, dist):
        def counted(*args, **kwargs):
            if self.on:
                tensors = [a for a in (*args, *kwargs.values()) if hasattr(a, "element_size")]
                # The larger tensor: an all-reduce's only one, a reduce-scatter's input, an all-gather's output.
                size = max(t.numel() * t.element_size() for t in tensors)
                ranks = dist.get_world_size(kwargs.get("group"))
                self.calls += 1
                self.handed += size
                self.ring += size * factor(ranks)
            return original(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def counting(self):
        self.on = True
        try:
            yield
        finally:
            self.on = False


def worker(out: Path, steps: int, dim: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from forge_lm.config import load_config
    from forge_lm.plugins import PluginManager, PluginSettings

    try:  # the run's parts, as forge train builds them (moved out of the loop's module by its refactoring)
        from forge_lm.train.parts import build_parts
    except ImportError:
        from forge_lm.train.loop import _build as build_parts

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counter = Counter()
    manager = PluginManager(PluginSettings(autoload=False))
    common = [
        f"--model.dim={dim}",
        "--model.n_layers=2",
        "--train.seq_len=128",
        "--train.batch_size=4",
        "--eval.interval=0",
        "--distributed.dp_replicate=2",
        "--distributed.dp_shard=1",
        "--resilience.health_check=false",
        "--metrics.backends=[]",
    ]
    built = {}
    for name, extra in VARIANTS.items():
        config = load_config(str(HERE.parent / "configs" / "debug.toml"), [*common, *extra], manager.registry)
        built[name] = build_parts(config, manager)
    parameters = sum(p.numel() for p in next(iter(built.values())).model.parameters())
    generator = torch.Generator().manual_seed(dist.get_rank())
    vocab = next(iter(built.values())).model.output.weight.shape[0]

    def one_step(parts) -> tuple[float, int, float, int]:
        tokens = torch.randint(0, vocab, (4, 129), generator=generator)
        parts.optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        logits = parts.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        counter.calls = counter.handed = 0
        counter.ring = 0.0
        with counter.counting():
            loss.backward()
        parts.optimizer.step()
        dist.barrier()
        return time.perf_counter() - start, counter.handed, counter.ring, counter.calls

    samples: dict[str, list] = {name: [] for name in VARIANTS}
    for round_index in range(steps + 2):  # alternating, so that drifting load hits every variant alike
        for name, parts in built.items():
            measured = one_step(parts)
            if round_index >= 2:
                samples[name].append(measured)
    if dist.get_rank() == 0:
        rows = []
        for name, values in samples.items():
            rows.append(
                {
                    "reduction": name,
                    "bytes_handed_per_step": values[-1][1],
                    "ring_bytes_sent_per_rank": round(values[-1][2]),
                    "collectives_per_step": values[-1][3],
                    "step_ms_median": round(1000 * statistics.median(v[0] for v in values), 1),
                }
            )
        fp32 = rows[0]["bytes_handed_per_step"]
        for row in rows:
            row["bytes_vs_fp32"] = round(row["bytes_handed_per_step"] / fp32, 4)
        out.write_text(json.dumps({"rows": rows, "parameters": parameters}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.dim)
        return
    from _record import save

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "reduce.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
        command += ["--steps", str(args.steps), "--dim", str(args.dim), "--worker", str(out)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=HERE.parent)
        result = json.loads(out.read_text())
    rows = result["rows"]
    for row in rows:
        print(
            f"{row['reduction']:28s} {row['bytes_handed_per_step']:>10,d} B/step ({row['bytes_vs_fp32']:.3f} of fp32)"
            f"  {row['step_ms_median']:7.1f} ms/step"
        )
    powersgd, bf16 = rows[2], rows[1]
    save(
        "reduce",
        f"python benchmarks/bench_reduce.py --steps {args.steps} --dim {args.dim}",
        rows,
        notes=(
            f"2 gloo ranks on one CPU host as 2 replicas (dp_replicate = 2, dp_shard = 1); the debug config at dim "
            f"{args.dim}, 2 layers, seq 128, batch 4 ({result['parameters']:,d} parameters). Bytes: what each rank "
            "handed to collectives during backward (the gradient reduction), counted by wrapping torch.distributed's "
            "collectives; ring bytes: what a ring algorithm sends per rank for them. Bytes are exact and "
            f"load-independent; step times are medians of {args.steps} alternating steps after 2 warm-up rounds, "
            "measured while other work shared the machine's 2 cores: indicative only."
        ),
        headline=[
            {
                "measure": "gradient bytes per step, PowerSGD rank 4 / fp32 all-reduce (2 replicas)",
                "value": powersgd["bytes_vs_fp32"],
                "meaning": f"below 1: compression sends less; bf16 reduction: {bf16['bytes_vs_fp32']:.3f}",
            }
        ],
    )


if __name__ == "__main__":
    main()
