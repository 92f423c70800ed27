"""Training throughput: Forge's training step against a hand-written plain PyTorch loop.

Forge's side is the step as ``forge train`` builds it: the model, optimizer (AdamW), scheduler,
loss and data (``python_stdlib`` through ``BatchLoader``) of the default config, built from
the plugin registry by ``forge_lm.train``'s own builders, and each step is the loop's body:
``_train_step`` (forward under autocast, loss, aux-loss collection, backward, gradient
clipping), the non-finite check, ``optimizer.step()``, ``scheduler.step()``, the
``forge_lm_step_end`` hook and, every ``metrics.log_interval`` steps, tokens/s, MFU and the
metrics backends (console and jsonl). One more row runs ``forge_lm.train.train()`` itself, a
fresh run of ``--steps`` steps per round, and reads the tokens/s it logs over them: a check
that the step measured here is the loop's.

The baseline is a plain loop over the same model (a copy of the same object, same weights):
``torch.optim.AdamW`` with the same hyper-parameters and decay groups, ``F.cross_entropy``,
``clip_grad_norm_``, the same batches pre-stacked as plain tensors (no loader), the same
precision. Before the first step both sides hold the same weights and batch, so their first
losses and gradient norms must agree: the script checks that they do (same work).

Every variant runs a block of ``--steps`` steps per round; variants alternate round by round
after ``--warmup`` rounds; medians of tokens/s over ``--rounds`` rounds are reported, with the
ratio to the plain loop and the model FLOP/s as a fraction of the machine's measured matmul
peak (the best of ``torch.mm`` in fp32 and bf16 and ``F.linear`` under bf16 autocast, at a
few sizes, measured here). Extra rows try
what could make Forge faster: AdamW's ``foreach`` and ``fused`` implementations (set on the
built optimizer; Forge's ``adamw`` has no option for them), bf16 autocast
(``train.precision``), attention without the per-document mask, and with ``--compile``
``torch.compile`` (``train.compile``; about a minute of compilation per model on a small CPU,
so not in the default run).

Run:  .venv/bin/python benchmarks/bench_train.py [--rounds 5 --steps 10] [--compile] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _record import alternate, median, save

from forge_lm.config import load_config, to_data
from forge_lm.data.loader import BatchLoader
from forge_lm.distributed.reduce import agree_on_step
from forge_lm.metrics.mfu import cpu_peak_flops, mfu
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import loop
from forge_lm.train.components import build, build_dataset

# --------------------------------------------------------------------------------------
# The machine's matmul peak
# --------------------------------------------------------------------------------------


def matmul_peaks(sizes: tuple[int, ...], budget_s: float) -> list[dict[str, Any]]:
    """FLOP/s of the matmul kernels training can use, per size (best of 3 after a warm-up):
    ``torch.mm`` in fp32 and in bf16, and ``F.linear`` under bf16 autocast (on CPU a oneDNN
    kernel, which can be far faster than ``torch.mm`` in bf16). A size whose one matmul takes
    more than ``budget_s`` ends that kernel's series (bf16 without bf16 hardware)."""
    kernels: dict[str, tuple[torch.dtype, Callable[[torch.Tensor, torch.Tensor], Any]]] = {
        "torch.mm fp32": (torch.float32, torch.mm),
        "torch.mm bf16": (torch.bfloat16, torch.mm),
        "F.linear bf16 autocast": (torch.float32, _linear_bf16),
    }
    rows = []
    for kernel, (dtype, function) in kernels.items():
        for size in sizes:
            generator = torch.Generator().manual_seed(0)
            a = torch.randn(size, size, generator=generator).to(dtype)
            b = torch.randn(size, size, generator=generator).to(dtype)
            start = time.perf_counter()
            function(a, b)
            best = time.perf_counter() - start
            repeats = 3 if best < budget_s else 0
            for _ in range(repeats):
                start = time.perf_counter()
                function(a, b)
                best = min(best, time.perf_counter() - start)
            rows.append({"kernel": kernel, "size": size, "gflop_per_s": 2 * size**3 / best / 1e9})
            if best >= budget_s:
                break
    return rows


def _linear_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.linear(a, b)


# --------------------------------------------------------------------------------------
# Forge's side: built as forge train builds it, stepped as its loop steps
# --------------------------------------------------------------------------------------


class ForgeSide:
    """The default run's components, built by ``forge_lm.train``'s builders, ready to step."""

    def __init__(self, overrides: list[str], workdir: Path, settings: PluginSettings, optimizer_impl: str) -> None:
        self.manager = manager = PluginManager(settings)
        registry = manager.registry
        self.config = config = load_config(None, [*overrides, f"--train.output_dir={workdir}"], registry)
        manager.configure(config)
        self.parts = parts = loop._build(config, manager)  # exactly what forge train builds
        self.device, self.dtype = parts.device, parts.dtype
        self.model, self.optimizer, self.scheduler = parts.model, parts.optimizer, parts.scheduler
        if optimizer_impl != "default":  # what an option of Forge's adamw could set
            for group in self.optimizer.param_groups:
                group[optimizer_impl] = True
        self.vocab_size = loop._vocab_size(config, build(registry, "tokenizers", config.tokenizer))
        # The plain loop's copy: same class, same weights, never compiled.
        self.initial_model = build_model(config.model, self.vocab_size, registry).to(self.device)
        self.initial_model.load_state_dict(self.model.state_dict())
        self.loss_fn, self.loader, self.backends = parts.loss_fn, parts.train_batches, parts.backends
        self.tokens_per_step = parts.tokens_per_step
        self.step_flops, self.peak = parts.flops_per_token, parts.peak_flops
        self.context = loop.TrainContext(config, workdir, self.model, self.optimizer, self.scheduler)
        with quiet():
            for backend in self.backends:
                backend.start(to_data(config), manager.manifest())
            manager.hook.forge_lm_train_start(context=self.context)
        self.batches = loop._on_device(iter(self.loader), self.device)
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.first: tuple[float, float] | None = None  # (loss, grad norm) of the first step

    def fresh_batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        """The first ``count`` batches this side's loader hands out, from a loader of their own."""
        dataset = build_dataset(
            self.config, self.manager.registry, build(self.manager.registry, "tokenizers", self.config.tokenizer),
            self.vocab_size, "train",
        )  # fmt: skip
        batches = iter(BatchLoader(dataset, self.config.train.batch_size))
        return [{k: v.to(self.device) for k, v in next(batches).items()} for _ in range(count)]

    def run(self, steps: int) -> float:
        """Tokens/s of ``steps`` steps of the training loop's body (``forge_lm.train.loop.train``)."""
        config, context, optimizer = self.config, self.context, self.optimizer
        start = time.perf_counter()
        with quiet():
            for _ in range(steps):
                lr = optimizer.param_groups[0]["lr"]
                local_loss, norm, reports = loop._train_step(self.parts, self.batches, config)
                step_loss, finite, _ = agree_on_step(local_loss, norm, False, self.parts.dims)
                if not finite:
                    raise RuntimeError("non-finite loss or gradient norm in the benchmark")
                if self.first is None:  # read once, after the loop's own single read of the step
                    self.first = (step_loss.item(), norm.item())
                optimizer.step()
                self.scheduler.step()
                context.step += 1
                context.tokens_seen += self.tokens_per_step
                step, self.window_steps = context.step, self.window_steps + 1
                logging = step % config.metrics.log_interval == 0
                metrics: dict[str, float] = {"lr": lr}
                if logging:  # as the loop: the numbers leave the device only on logged steps
                    loss, grad_norm = torch.stack([step_loss.double(), norm.double()]).tolist()
                    metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, **reports.logged()}
                for extra in self.manager.hook.forge_lm_step_end(context=context, step=step, metrics=dict(metrics)):
                    metrics.update(extra)
                if logging:
                    elapsed = time.perf_counter() - self.window_start
                    tokens_per_sec = self.tokens_per_step * self.window_steps / elapsed
                    metrics["tokens_per_sec"] = tokens_per_sec
                    metrics["mfu"] = mfu(self.step_flops, tokens_per_sec, self.peak)
                    loop._log(self.backends, step, metrics)
                    self.window_start, self.window_steps = time.perf_counter(), 0
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return self.tokens_per_step * steps / (time.perf_counter() - start)

    def close(self) -> None:
        with quiet():
            self.manager.hook.forge_lm_train_end(context=self.context, status="completed")
            for backend in self.backends:
                backend.finish({})


# --------------------------------------------------------------------------------------
# The baseline: a plain PyTorch loop
# --------------------------------------------------------------------------------------


class PlainSide:
    """A hand-written loop over a copy of Forge's model and the same batches as plain tensors."""

    def __init__(
        self,
        forge: ForgeSide,
        batches: list[dict[str, torch.Tensor]],
        optimizer_impl: str = "default",
        document_mask: bool = True,
        compile_model: bool = False,
    ) -> None:
        options = forge.config.optimizer.options
        self.model = copy.deepcopy(forge.initial_model)
        named = list(self.model.named_parameters())  # a tied head is listed once, as the embedding
        decay = [p for n, p in named if p.ndim >= 2 and not n.startswith("tok_embeddings.")]
        no_decay = [p for n, p in named if not (p.ndim >= 2 and not n.startswith("tok_embeddings."))]
        kwargs = {} if optimizer_impl == "default" else {optimizer_impl: True}
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": options.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=options.lr, betas=tuple(options.betas), eps=options.eps, **kwargs,
        )  # fmt: skip
        self.forward = torch.compile(self.model) if compile_model else self.model
        self.inputs = [b["input_ids"] for b in batches]
        self.labels = [b["labels"] for b in batches]
        self.documents = [b.get("document_ids") if document_mask else None for b in batches]
        self.device_type = forge.device.type
        self.dtype = forge.dtype
        self.grad_clip = forge.config.train.grad_clip or math.inf  # 0: no clipping, but the norm still measured
        self.tokens_per_step = forge.tokens_per_step
        self.index = 0
        self.first: tuple[float, float] | None = None

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            i = self.index % len(self.inputs)
            self.index += 1
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None):
                logits = self.forward(self.inputs[i], self.documents[i])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), self.labels[i].flatten())
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            if self.first is None:
                self.first = (loss.item(), grad_norm.item())
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        return self.tokens_per_step * steps / (time.perf_counter() - start)


# --------------------------------------------------------------------------------------
# The real loop, end to end
# --------------------------------------------------------------------------------------


def train_end_to_end(overrides: list[str], steps: int, settings: PluginSettings) -> float:
    """Tokens/s that ``forge_lm.train.train()`` logs for a fresh run of ``steps`` steps, logged
    once at the end (its window starts after every component is built; the checkpoint that
    ends the run is written after the window, so it does not count)."""
    with tempfile.TemporaryDirectory(prefix="forge-bench-train-") as workdir:
        manager = PluginManager(settings)
        config = load_config(
            None,
            [
                *overrides,
                f"--train.output_dir={workdir}/run",
                f"--train.max_steps={steps}",
                f"--metrics.log_interval={steps}",
                "--eval.interval=0",
            ],
            manager.registry,
        )
        manager.configure(config)
        with quiet():
            loop.train(config, manager)
        records = [json.loads(line) for line in (Path(workdir) / "run" / "metrics.jsonl").read_text().splitlines()]
        return next(r["tokens_per_sec"] for r in records if r["step"] == steps and "tokens_per_sec" in r)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The console backend's lines and progress go nowhere (its cost is still paid)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (each variant runs one block per round)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per block (default: log_interval)")
    parser.add_argument(
        "--bf16-steps",
        type=int,
        default=None,
        help="steps per block of the bf16 rows (default: --steps, or a fifth of it where bf16 matmuls are slow)",
    )
    parser.add_argument(
        "--bf16-batch",
        type=int,
        default=None,
        help="batch size of the bf16 rows (default: the config's, or a quarter of it where bf16 matmuls are slow)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="train.device of both sides (default cpu)")
    parser.add_argument("--compile", action="store_true", help="add torch.compile rows (about a minute per model)")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the bf16 autocast rows")
    parser.add_argument("--no-e2e", action="store_true", help="leave out the forge_lm.train.train() row")
    parser.add_argument("--no-plugin-autoload", action="store_true", help="only the core's built-in components")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 2 steps, no warm-up round")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write results/train.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.steps = 2, 0, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = PluginSettings(autoload=False) if args.no_plugin_autoload else PluginSettings.from_env()

    print("measuring the matmul peak (torch.mm fp32 and bf16, F.linear under bf16 autocast) ...", flush=True)
    peaks = matmul_peaks((256, 512, 1024, 2048), budget_s=1.0 if not args.quick else 0.3)
    best = {name: max(r["gflop_per_s"] for r in peaks if name in r["kernel"]) * 1e9 for name in ("fp32", "bf16")}
    machine_peak = max(best.values())
    for row in peaks:
        print(f"  {row['kernel']:24s} {row['size']:5d}  {row['gflop_per_s']:8.2f} GFLOP/s")
    bf16_slow = best["bf16"] < best["fp32"] / 2
    bf16_steps = args.bf16_steps or (max(1, args.steps // 5) if bf16_slow else args.steps)

    base = [f"--train.device={args.device}"]
    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-train-"))
    sides: dict[str, Any] = {}
    plans: dict[str, dict[str, Any]] = {}  # name -> {run, steps, loop, precision, baseline}

    def add(name: str, side: Any, steps: int, loop_name: str, precision: str, baseline: str, how: str) -> None:
        sides[name] = side
        plans[name] = {"steps": steps, "loop": loop_name, "precision": precision, "baseline": baseline, "how": how}

    def forge(tag: str, overrides: list[str], impl: str = "default") -> ForgeSide:
        return ForgeSide([*base, *overrides], workdir / tag, settings, impl)

    print("building ...", flush=True)
    fp32 = forge("fp32", ["--train.precision=fp32"])
    batches = fp32.fresh_batches(32)
    default_adamw = "for-loop" if fp32.device.type == "cpu" else "foreach"  # what torch picks when not told
    add(
        "forge fp32", fp32, args.steps, "forge", "fp32", "plain fp32",
        f"`forge train` defaults; AdamW as torch picks it ({default_adamw})",
    )  # fmt: skip
    add(
        "plain fp32", PlainSide(fp32, batches), args.steps, "plain", "fp32", "plain fp32",
        f"torch.optim.AdamW ({default_adamw}), F.cross_entropy, clip_grad_norm_",
    )  # fmt: skip
    if not args.no_e2e:
        add(
            "forge train() fp32", None, args.steps, "forge train()", "fp32", "plain fp32",
            "forge_lm.train.train(): a fresh run per round, its own logged tokens/s",
        )  # fmt: skip
    for impl in ("foreach", "fused"):
        add(
            f"forge fp32 AdamW {impl}",
            forge(f"fp32-{impl}", ["--train.precision=fp32"], impl),
            args.steps, "forge", "fp32", "plain fp32", f"AdamW {impl}=True on the built optimizer",
        )  # fmt: skip
    add(
        "plain fp32 AdamW fused", PlainSide(fp32, batches, "fused"), args.steps, "plain", "fp32", "plain fp32",
        "torch.optim.AdamW(fused=True)",
    )  # fmt: skip
    add(
        "plain fp32 causal only", PlainSide(fp32, batches, document_mask=False), args.steps, "plain", "fp32",
        "plain fp32", "no document mask: SDPA is_causal (other semantics: attends across documents)",
    )  # fmt: skip
    bf16_batch = args.bf16_batch or (
        max(1, fp32.config.train.batch_size // 4) if bf16_slow else fp32.config.train.batch_size
    )
    if not args.no_bf16:
        bf16 = forge("bf16", ["--train.precision=bf16", f"--train.batch_size={bf16_batch}"])
        how = f"--train.precision=bf16, batch {bf16_batch}"
        add("forge bf16", bf16, bf16_steps, "forge", "bf16", "plain bf16", how)
        add(
            "plain bf16", PlainSide(bf16, bf16.fresh_batches(8)), bf16_steps, "plain", "bf16", "plain bf16",
            f"torch.autocast bf16, batch {bf16_batch}",
        )  # fmt: skip
    if args.compile:
        compiled = forge("fp32-compile", ["--train.precision=fp32", "--train.compile=true"])
        add("forge fp32 compile", compiled, args.steps, "forge", "fp32", "plain fp32 compile", "--train.compile=true")
        add(
            "plain fp32 compile", PlainSide(fp32, batches, compile_model=True), args.steps, "plain", "fp32",
            "plain fp32 compile", "torch.compile(model)",
        )  # fmt: skip

    def runner(name: str) -> Callable[[], float]:
        steps = plans[name]["steps"]
        if sides[name] is None:
            return lambda: train_end_to_end([*base, "--train.precision=fp32"], steps, settings)
        return lambda: sides[name].run(steps)

    variants = {name: runner(name) for name in plans}
    started = time.perf_counter()

    def progress(round_index: int) -> None:
        kind = "warm-up" if round_index < args.warmup else "timed"
        elapsed = time.perf_counter() - started
        print(f"  round {round_index + 1}/{args.warmup + args.rounds} ({kind}) done, {elapsed:.0f} s", flush=True)

    print(f"{len(variants)} variants, {args.warmup} warm-up + {args.rounds} timed rounds", flush=True)
    samples = alternate(variants, args.rounds, args.warmup, progress, rotate=True)
    for side in sides.values():
        if isinstance(side, ForgeSide):
            side.close()

    medians = {name: median(values) for name, values in samples.items()}
    rows = []
    for name, plan in plans.items():
        flops = fp32.step_flops * medians[name]
        rows.append(
            {
                "variant": name,
                "tokens_per_s": medians[name],
                "min": min(samples[name]),
                "max": max(samples[name]),
                "baseline": plan["baseline"],
                "x_baseline": medians[name] / medians[plan["baseline"]],
                "x_forge_fp32": medians[name] / medians["forge fp32"],
                "mfu_machine_peak": flops / machine_peak,
                "mfu_dtype_peak": flops / best[plan["precision"]],
                "how": plan["how"],
            }
        )
    for row in rows:
        print(
            f"{row['variant']:26s} {row['tokens_per_s']:9.0f} tok/s  x{row['x_baseline']:.3f} vs {row['baseline']:18s}"
            f" x{row['x_forge_fp32']:.3f} vs forge fp32  MFU {100 * row['mfu_machine_peak']:.1f}%"
        )

    same = []
    for forge_name, plain_name in (("forge fp32", "plain fp32"), ("forge bf16", "plain bf16")):
        if forge_name in sides and sides[forge_name].first and sides[plain_name].first:
            (fl, fg), (pl, pg) = sides[forge_name].first, sides[plain_name].first
            same.append(f"{forge_name}: loss {fl:.6f} vs {pl:.6f}, grad norm {fg:.6f} vs {pg:.6f}")
    print("first step, same weights and batch: " + "; ".join(same))

    config = fp32.config
    cached = cpu_peak_flops(torch.float32) if fp32.device.type == "cpu" else fp32.peak
    model = config.model
    sentences = [
        f"Default model ({model.n_layers} layers, dim {model.dim}, {model.n_heads} heads, "
        f"{sum(p.numel() for p in fp32.model.parameters()) / 1e6:.2f} M parameters, "
        f"{fp32.step_flops / 1e6:.1f} MFLOP per token), batch {config.train.batch_size} x seq "
        f"{config.train.seq_len} = {fp32.tokens_per_step} tokens per step, device {fp32.device}.",
        f"Medians of {args.rounds} alternating rounds after {args.warmup} warm-up round(s); a round runs "
        f"{args.steps} steps of each variant ({bf16_steps} of batch {bf16_batch} for bf16).",
        "`x_baseline`: tokens/s over the baseline's (1.0 = Forge costs nothing over a plain loop); "
        "`x_forge_fp32`: over Forge's default.",
        f"MFU = {fp32.step_flops / 1e6:.1f} MFLOP/token x tokens/s over the best measured matmul rate: "
        f"`mfu_machine_peak` over the best of all kernels ({machine_peak / 1e9:.1f} GFLOP/s), `mfu_dtype_peak` "
        f"over the best of the row's dtype (fp32 {best['fp32'] / 1e9:.1f}, bf16 {best['bf16'] / 1e9:.2f} "
        f"GFLOP/s); Forge's own MFU metric uses its cached peak ({cached / 1e9:.1f} GFLOP/s).",
        "Same work: first step from the same weights and batch, " + ("; ".join(same) or "not checked") + ".",
    ]
    if bf16_slow and not args.no_bf16:
        sentences.append(
            f"bf16 has no fast matmul on this CPU (best bf16 kernel {best['bf16'] / 1e9:.2f} GFLOP/s vs fp32 "
            f"{best['fp32'] / 1e9:.1f}): bf16 autocast is a GPU speed-up, not a CPU one; the bf16 rows run a "
            f"batch of {bf16_batch} to keep the benchmark short (`--bf16-batch` sets it)."
        )
    if not args.compile:
        sentences.append(
            "torch.compile rows: `python benchmarks/bench_train.py --compile` (about a minute of compilation "
            "per model on 2 cores, so not in the default run)."
        )
    notes = " ".join(sentences)
    headline = [
        {
            "measure": "Forge training step / plain PyTorch loop, tokens/s (fp32, default model)",
            "value": medians["forge fp32"] / medians["plain fp32"],
            "meaning": "1.0 = Forge costs nothing over a hand-written loop",
        },
        {
            "measure": "Forge training step, MFU of the measured matmul peak (fp32)",
            "value": fp32.step_flops * medians["forge fp32"] / machine_peak,
            "meaning": "fraction of the best torch.mm rate on this machine",
        },
    ]
    if "forge train() fp32" in medians:
        headline.append(
            {
                "measure": "`forge_lm.train.train()` (whole loop) / plain PyTorch loop, tokens/s (fp32)",
                "value": medians["forge train() fp32"] / medians["plain fp32"],
                "meaning": "the loop as `forge train` runs it",
            }
        )
    fastest = max((n for n in medians if plans[n]["loop"] == "forge"), key=medians.get)
    headline.append(
        {
            "measure": f"fastest Forge variant ({fastest}) / Forge default, tokens/s",
            "value": medians[fastest] / medians["forge fp32"],
            "meaning": plans[fastest]["how"],
        }
    )
    command = "python benchmarks/bench_train.py " + " ".join(sys.argv[1:])
    if not args.no_save:
        tables = {"matmul peak (best of 3 per kernel and size)": peaks}
        path = save("train", command.strip(), rows, notes, tables=tables, headline=headline)
        print(f"wrote {path}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
