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
what could make Forge faster or slower: AdamW's other implementations
(``[optimizer] implementation``; Forge's default is torch's fused kernel), bf16 autocast
(``train.precision``), attention without the per-document mask, and with ``--compile``
``torch.compile`` (``train.compile``; about a minute of compilation per model on a small CPU,
so not in the default run).

Run:  .venv/bin/python benchmarks/bench_train.py [--rounds 5 --steps 10] [--compile] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from _record import alternate, median, save

from forge_lm.config import load_config, to_data
from forge_lm.data.loader import BatchLoader
from forge_lm.distributed.reduce import agree_on_step
from forge_lm.metrics.cpu_peak import CPUINFO_PATH, cpu_peak_flops, parse_cpuinfo, theoretical_cpu_peak
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.metrics.mfu import mfu
from forge_lm.model import build_model
from forge_lm.model.attention import EAGER_MAX_KEYS, attention_mask, eager_attention, uses_eager
from forge_lm.model.linear import kernel as linear_kernel
from forge_lm.model.linear import onednn_available
from forge_lm.model.memory import model_vocab_size
from forge_lm.model.swiglu import swiglu_hidden
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import loop
from forge_lm.train.builders import build_dataset
from forge_lm.train.parts import build_parts
from forge_lm.train.run import TrainContext
from forge_lm.train.step import compute_gradients, on_device

# The larger models: label -> (dim, heads, divisor of --steps for their blocks), about 4x and
# 16x the default model's parameters.
GROWN = {"4x": (512, 8, 3), "16x": (1024, 16, 6)}
# A tiny model (about 1 M parameters, batch 12 x 64 tokens, logging every step): where a fixed
# cost per step that is noise at the default size would be most of a step (issue 35).
TINY = ["--model.dim=128", "--model.n_heads=4", "--model.n_layers=5", "--train.batch_size=12", "--train.seq_len=64",
        "--metrics.log_interval=1"]  # fmt: skip

# A model with next to no compute (one block of width 16, one sequence of 16 tokens per step):
# what a step of it costs is the loop's fixed cost per step (loader, hooks, guards, clipping,
# the host sync, metrics every step), Forge's against the plain loop's; divided by a real
# model's step time it is the framework's overhead at that size, without the noise of a ratio of
# two long measurements.
MICRO = ["--model.dim=16", "--model.n_heads=1", "--model.n_layers=1", "--train.batch_size=1", "--train.seq_len=16",
         "--metrics.log_interval=1"]  # fmt: skip
MICRO_STEPS = 10  # micro-model steps per default-model step of a block: each is about 100x shorter

# Forge on the kernels the plain loop takes (nn.Linear's F.linear, SDPA's attention): the
# difference left between the two is the framework's own overhead.
PLAIN_KERNELS = ["--train.cpu_linear_kernel=aten", "--model.attention_backend=sdpa"]
# Sequence lengths of the attention table: around the CPU limits of "auto"'s eager attention.
ATTENTION_LENGTHS = (64, 128, 192, 256, 384, 512, 768)

# --------------------------------------------------------------------------------------
# The machine's matmul peak
# --------------------------------------------------------------------------------------


def matmul_peaks(sizes: tuple[int, ...], budget_s: float) -> list[dict[str, Any]]:
    """FLOP/s of the matmul kernels training can use, per size (best of 7 after a warm-up):
    ``torch.mm`` in fp32 (MKL's sgemm) and in bf16, ``F.linear`` under bf16 autocast (on CPU a
    oneDNN kernel), and the oneDNN fp32 product Forge's linear layers take. A size whose one
    matmul takes more than ``budget_s`` ends that kernel's series (bf16 without bf16 hardware)."""
    kernels: dict[str, tuple[torch.dtype, Callable[[torch.Tensor, torch.Tensor], Any]]] = {
        "torch.mm fp32": (torch.float32, torch.mm),
        "torch.mm bf16": (torch.bfloat16, torch.mm),
        "F.linear bf16 autocast": (torch.float32, _linear_bf16),
    }
    if onednn_available():  # the fp32 product of Forge's linear layers (forge_lm.model.linear)
        kernels["oneDNN linear fp32"] = (torch.float32, torch.ops.forge.onednn_linear)
    rows = []
    for kernel, (dtype, function) in kernels.items():
        for size in sizes:
            generator = torch.Generator().manual_seed(0)
            a = torch.randn(size, size, generator=generator).to(dtype)
            b = torch.randn(size, size, generator=generator).to(dtype)
            start = time.perf_counter()
            function(a, b)
            best = time.perf_counter() - start
            repeats = 7 if best < budget_s else 0
            for _ in range(repeats):
                start = time.perf_counter()
                function(a, b)
                best = min(best, time.perf_counter() - start)
            rows.append({"kernel": kernel, "size": size, "gflop_per_s": 2 * size**3 / best / 1e9})
            if best >= budget_s:
                break
    return rows


def linear_products(tokens: int, dim_in: int, dim_out: int, repeats: int = 5) -> list[dict[str, Any]]:
    """GFLOP/s of the three products of one fp32 linear layer (``tokens`` x ``dim_in`` ->
    ``dim_out``: forward, input gradient, weight gradient) on MKL (``torch.mm``, what
    ``F.linear`` takes) and on oneDNN (what Forge's layers take): where the speed-up comes from."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim_in, generator=generator)
    w = torch.randn(dim_out, dim_in, generator=generator)
    g = torch.randn(tokens, dim_out, generator=generator)
    onednn = torch.ops.mkldnn._linear_pointwise if onednn_available() else None
    products = {
        "forward x @ W.T": (lambda: torch.mm(x, w.t()), lambda: onednn(x, w, None, "none", [], "")),
        "input gradient g @ W": (lambda: torch.mm(g, w), lambda: onednn(g, w.t(), None, "none", [], "")),
        "weight gradient g.T @ x": (lambda: torch.mm(g.t(), x), lambda: onednn(g.t(), x.t(), None, "none", [], "")),
    }
    rows = []
    flop = 2 * tokens * dim_in * dim_out
    for product, (mkl, dnn) in products.items():
        row: dict[str, Any] = {"product": product, "shape": f"{tokens}x{dim_in}->{dim_out}"}
        for name, run in (("mkl_gflop_per_s", mkl), ("onednn_gflop_per_s", dnn if onednn else None)):
            if run is None:
                row[name] = None
                continue
            run()
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            row[name] = flop / best / 1e9
        row["x_mkl"] = row["onednn_gflop_per_s"] / row["mkl_gflop_per_s"] if onednn else None
        rows.append(row)
    return rows


def attention_kernels(
    tokens: int,
    heads: int,
    head_dim: int,
    dtypes: tuple[str, ...],
    repeats: int = 5,
    lengths: tuple[int, ...] = ATTENTION_LENGTHS,
) -> list[dict[str, Any]]:
    """Forward + backward of one attention layer's core (after the projections) at several
    sequence lengths, ``tokens`` per batch, packed documents: SDPA with its dense boolean mask
    (its CPU flash kernel) against :func:`~forge_lm.model.attention.eager_attention` with the
    additive mask, in each dtype; best of ``repeats``. The measurements behind ``"auto"``'s
    choice on CPU (:data:`~forge_lm.model.attention.EAGER_MAX_KEYS`)."""
    rows, cpu = [], torch.device("cpu")
    for length in lengths:
        batch = max(1, tokens // length)
        documents = torch.arange(length).expand(batch, length) * 3 // length  # three documents per row
        # The masks the model builds: SDPA's boolean one and eager attention's additive bias.
        allowed, _ = attention_mask(documents, 0, length, cpu, "sdpa")
        for dtype_name in dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            bias, _ = attention_mask(documents, 0, length, cpu, "eager", dtype)
            generator = torch.Generator().manual_seed(0)
            q, k, v = (
                torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype).requires_grad_()
                for _ in range(3)
            )
            grad = torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype)
            kernels = {
                "sdpa": functools.partial(F.scaled_dot_product_attention, attn_mask=allowed),
                "eager": functools.partial(eager_attention, bias=bias),
            }
            best = {name: _best_backward(kernel, (q, k, v), grad, repeats) for name, kernel in kernels.items()}
            rows.append(
                {
                    "keys": length,
                    "batch": batch,
                    "dtype": dtype_name,
                    "sdpa_ms": best["sdpa"] * 1e3,
                    "eager_ms": best["eager"] * 1e3,
                    "x_sdpa": best["sdpa"] / best["eager"],
                    "auto_picks": "eager" if uses_eager("auto", cpu, length, dtype) else "sdpa",
                }
            )
    return rows


def _best_backward(
    function: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, repeats: int
) -> float:
    """The best time of ``function(*inputs).backward(grad)`` over ``repeats`` runs after one."""
    function(*inputs).backward(grad)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        function(*inputs).backward(grad)
        best = min(best, time.perf_counter() - start)
    return best


def cpu_features() -> dict[str, Any]:
    """What the CPU has for matrix products, from /proc/cpuinfo's flags (empty off Linux)."""
    try:
        processors = parse_cpuinfo(CPUINFO_PATH.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return {}
    first = processors[0] if processors else {}
    flags = set(first.get("flags", "").split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": first.get("model name", "unknown"), **{flag: flag in flags for flag in wanted}}


def _linear_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.linear(a, b)


# --------------------------------------------------------------------------------------
# Forge's side: built as forge train builds it, stepped as its loop steps
# --------------------------------------------------------------------------------------


class ForgeSide:
    """The default run's components, built by ``forge_lm.train``'s builders, ready to step."""

    def __init__(
        self, overrides: list[str], workdir: Path, settings: PluginSettings, *, plain_copy: bool = True
    ) -> None:
        self.manager = manager = PluginManager(settings)
        registry = manager.registry
        self.config = config = load_config(None, [*overrides, f"--train.output_dir={workdir}"], registry)
        manager.configure(config)
        self.parts = parts = build_parts(config, manager)  # exactly what forge train builds
        self.device, self.dtype = parts.device, parts.dtype
        self.model, self.optimizer, self.scheduler = parts.model, parts.optimizer, parts.scheduler
        self.vocab_size = model_vocab_size(config, config.tokenizer.build())
        # The plain loop's copy: same class, same weights, never compiled. Without plain_copy, none:
        # a side measured against a plain loop of its own (bench_gpu.py), whose peak memory must not
        # count a copy, and whose model may be FSDP2's (its state dict holds DTensors).
        self.initial_model = None
        if plain_copy:
            self.initial_model = build_model(config.model, self.vocab_size, registry).to(self.device)
            self.initial_model.load_state_dict(self.model.state_dict())
        self.loss_fn, self.loader, self.backends = parts.loss_fn, parts.train_batches, parts.backends
        self.tokens_per_step = parts.tokens_per_step
        self.step_flops, self.peak = parts.flops_per_token, parts.peak_flops
        self.context = TrainContext(config, workdir, self.model, self.optimizer, self.scheduler)
        with quiet():
            for backend in self.backends:
                backend.start(to_data(config), manager.manifest())
            manager.hook.forge_lm_train_start(context=self.context)
        self.batches = on_device(iter(self.loader), self.device)
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.first: tuple[float, float] | None = None  # (loss, grad norm) of the first step

    def fresh_batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        """The first ``count`` batches this side's loader hands out, from a loader of their own."""
        dataset = build_dataset(
            self.config, self.manager.registry, self.config.tokenizer.build(),
            self.vocab_size, "train",
        )  # fmt: skip
        batches = iter(BatchLoader(dataset, self.config.train.batch_size))
        return [{k: v.to(self.device) for k, v in next(batches).items()} for _ in range(count)]

    def run(self, steps: int) -> float:
        """Tokens/s of ``steps`` steps of the training loop's body (``forge_lm.train.loop.train``)."""
        config, context, optimizer = self.config, self.context, self.optimizer
        start = time.perf_counter()
        # The linear kernel is a process-wide switch that build_parts set for the last side built.
        with quiet(), linear_kernel(config.train.cpu_linear_kernel):
            for _ in range(steps):
                lr = optimizer.param_groups[0]["lr"]
                local_loss, norm, reports = compute_gradients(self.parts, self.batches, config)
                agreement = agree_on_step(local_loss, norm, False, self.parts.dims)
                step_loss, finite = agreement.loss, agreement.finite
                scaler = self.parts.loss_scaler  # precision = "fp16": an overflow skips the step, as in the loop
                if not finite and scaler is not None and scaler.overflowed(step_loss.item(), norm.item()):
                    optimizer.zero_grad(set_to_none=True)
                    continue
                if not finite:
                    raise RuntimeError("non-finite loss or gradient norm in the benchmark")
                if self.first is None:  # read once, after the loop's own single read of the step
                    self.first = (step_loss.item(), norm.item())
                optimizer.step()
                if scaler is not None:
                    scaler.stepped()
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
                    for backend in self.backends:
                        backend.log(step, metrics)
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
    """A hand-written loop over a copy of Forge's model and the same batches as plain tensors.
    Its linear layers run as ``nn.Linear`` does (``F.linear``): the kernel switch is "aten"; its
    attention is ``F.scaled_dot_product_attention`` (``attention_backend = "sdpa"``)."""

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
        # A hand-written model calls F.scaled_dot_product_attention: the copy takes SDPA whatever
        # Forge's "auto" picks (on CPU, eager attention for short sequences).
        self.model.config = attrs.evolve(self.model.config, attention_backend="sdpa")
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
        with linear_kernel("aten"):  # nn.Linear's own kernel: the model's layers are F.linear here
            return self._run(steps)

    def _run(self, steps: int) -> float:
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
        records = read_metrics(Path(workdir) / "run" / "metrics.jsonl")
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
    parser.add_argument(
        "--sizes",
        nargs="*",
        default=["micro", "tiny", "4x", "16x"],
        help="other model sizes to add: micro (one block of width 16, 16 tokens a step: the loop's fixed cost per "
        "step), tiny (about 1 M parameters, batch 12 x 64, logging every step), 4x, 16x the parameters (none: omit)",
    )
    parser.add_argument("--no-bf16", action="store_true", help="leave out the bf16 autocast rows")
    parser.add_argument("--no-e2e", action="store_true", help="leave out the forge_lm.train.train() row")
    parser.add_argument(
        "--no-mla", action="store_true", help="leave out the forge-deepseek latent-attention row (MLA against gqa)"
    )
    parser.add_argument("--no-plugin-autoload", action="store_true", help="only the core's built-in components")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 2 steps, no warm-up round")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write results/train.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.steps, args.sizes = 2, 0, 2, ["micro"]
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = PluginSettings(autoload=False) if args.no_plugin_autoload else PluginSettings.from_env()

    print("measuring the matmul peak (torch.mm fp32 and bf16, bf16 autocast, oneDNN fp32) ...", flush=True)
    peaks = matmul_peaks((256, 512, 1024, 2048), budget_s=1.0 if not args.quick else 0.3)
    best = {name: max(r["gflop_per_s"] for r in peaks if name in r["kernel"]) * 1e9 for name in ("fp32", "bf16")}
    # The models' own layer products count too (square matmuls alone can fall short of them):
    # the fp32 peak is the best rate any fp32 product reached in this run.
    products = []
    for dim in (256, *(GROWN[label][0] for label in args.sizes if label in GROWN)):
        cfg = load_config(None, [f"--model.dim={dim}"], PluginManager(settings).registry)
        products += linear_products(cfg.train.batch_size * cfg.train.seq_len, dim, swiglu_hidden_of(cfg))
    rates = [rate for row in products for rate in (row["mkl_gflop_per_s"], row["onednn_gflop_per_s"]) if rate]
    best["fp32"] = max(best["fp32"], max(rates) * 1e9)
    for row in peaks:
        print(f"  {row['kernel']:24s} {row['size']:5d}  {row['gflop_per_s']:8.2f} GFLOP/s")
    default = load_config(None, [], PluginManager(settings).registry)
    attention_tokens = default.train.batch_size * default.train.seq_len
    print("timing attention: SDPA against eager, by sequence length ...", flush=True)
    attention_rows = attention_kernels(
        attention_tokens, default.model.options.n_heads, default.model.options.dim // default.model.options.n_heads,
        ("fp32", "bf16") if best["bf16"] >= best["fp32"] / 2 else ("fp32",), repeats=2 if args.quick else 5,
    )  # fmt: skip
    theoretical = {
        name: theoretical_cpu_peak(dtype) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    features = cpu_features()
    bf16_slow = best["bf16"] < best["fp32"] / 2
    bf16_steps = args.bf16_steps or (max(1, args.steps // 5) if bf16_slow else args.steps)

    base = [f"--train.device={args.device}"]
    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-train-"))
    if args.compile:
        # An empty inductor cache of this run's own: the compile rows' start-up is what a
        # machine's first run of the model pays, not a reload of earlier runs' compiled code.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor-cache")
    sides: dict[str, Any] = {}
    plans: dict[str, dict[str, Any]] = {}  # name -> {steps, loop, precision, baseline, how, kernel, flops}

    def add(
        name: str, side: Any, steps: int, loop_name: str, precision: str, baseline: str, how: str, linear: str,
        flops: float | None = None,
    ) -> None:  # fmt: skip
        sides[name] = side
        plans[name] = {
            "steps": steps, "loop": loop_name, "precision": precision, "baseline": baseline, "how": how,
            "linear": linear, "flops": flops if flops is not None else side.step_flops,
        }  # fmt: skip

    def forge(tag: str, overrides: list[str]) -> ForgeSide:
        return ForgeSide([*base, *overrides], workdir / tag, settings)

    onednn = "oneDNN fp32 (forge_lm.model.linear)" if onednn_available() else "torch (no oneDNN in this build)"
    mkl = "F.linear (torch.mm's BLAS: MKL sgemm)"
    bf16_kernel = "F.linear under bf16 autocast (oneDNN bf16)"
    print("building ...", flush=True)
    fp32 = forge("fp32", ["--train.precision=fp32"])
    # The plain loop steps through the batches Forge's loader hands out over the whole run, in
    # order: both sides see the same data (document masks differ from batch to batch).
    blocks = args.warmup + args.rounds
    batches = fp32.fresh_batches(blocks * args.steps)
    default_adamw = "for-loop" if fp32.device.type == "cpu" else "foreach"  # what torch picks when not told
    forge_adamw = "fused" if fp32.optimizer.param_groups[0].get("fused") else default_adamw
    add(
        "forge fp32", fp32, args.steps, "forge", "fp32", "plain fp32",
        f"`forge train` defaults; AdamW {forge_adamw} (Forge's implementation = \"auto\")", onednn,
    )  # fmt: skip
    add(
        "plain fp32", PlainSide(fp32, batches), args.steps, "plain", "fp32", "plain fp32",
        f"torch.optim.AdamW ({default_adamw}), F.cross_entropy, clip_grad_norm_", mkl, fp32.step_flops,
    )  # fmt: skip
    add(
        "forge fp32 plain kernels", forge("fp32-plain-kernels", ["--train.precision=fp32", *PLAIN_KERNELS]),
        args.steps, "forge", "fp32", "plain fp32", f"{' '.join(PLAIN_KERNELS)}: Forge's overhead alone", mkl,
    )  # fmt: skip
    if not args.no_e2e:
        add(
            "forge train() fp32", None, args.steps, "forge train()", "fp32", "plain fp32",
            "forge_lm.train.train(): a fresh run per round, its own logged tokens/s", onednn, fp32.step_flops,
        )  # fmt: skip
    for impl in ("foreach", "for-loop"):
        add(
            f"forge fp32 AdamW {impl}",
            forge(f"fp32-{impl}", ["--train.precision=fp32", f"--optimizer.implementation={impl}"]),
            args.steps, "forge", "fp32", "plain fp32", f"[optimizer] implementation = \"{impl}\"", onednn,
        )  # fmt: skip
    add(
        "plain fp32 AdamW fused", PlainSide(fp32, batches, "fused"), args.steps, "plain", "fp32", "plain fp32",
        "torch.optim.AdamW(fused=True)", mkl, fp32.step_flops,
    )  # fmt: skip
    add(
        "plain fp32 causal only", PlainSide(fp32, batches, document_mask=False), args.steps, "plain", "fp32",
        "plain fp32", "no document mask: SDPA is_causal (other semantics: attends across documents)", mkl,
        fp32.step_flops,
    )  # fmt: skip
    # Multi-head latent attention (forge-deepseek's `mla`) in the same model: dim, heads, layers
    # and feed-forward unchanged, its own default ranks; against the gqa row above.
    if not args.no_mla and _has_component(settings, "attentions", "mla"):
        mla = forge("fp32-mla", ["--train.precision=fp32", "--model.attention.name=mla"])
        gqa_params = sum(p.numel() for p in fp32.model.parameters()) / 1e6
        mla_params = sum(p.numel() for p in mla.model.parameters()) / 1e6
        add(
            "forge fp32 mla", mla, args.steps, "forge", "fp32", "forge fp32",
            f"--model.attention.name=mla (forge-deepseek; {mla_params:.2f} M parameters against gqa's "
            f"{gqa_params:.2f} M)", onednn,
        )  # fmt: skip
    if "micro" in args.sizes:
        micro = forge("fp32-micro", ["--train.precision=fp32", *MICRO])
        micro_steps = args.steps * MICRO_STEPS
        add(
            "forge fp32 micro", micro, micro_steps, "forge", "fp32", "plain fp32 micro",
            f"{' '.join(MICRO)}: the loop's fixed cost per step", onednn,
        )  # fmt: skip
        add(
            "plain fp32 micro", PlainSide(micro, micro.fresh_batches(blocks * micro_steps), "fused"), micro_steps,
            "plain", "fp32", "plain fp32 micro", "the plain loop on that model, AdamW fused as Forge's", mkl,
            micro.step_flops,
        )  # fmt: skip
    if "tiny" in args.sizes:  # as many steps as the default row: each is about 20x shorter
        tiny = forge("fp32-tiny", ["--train.precision=fp32", *TINY])
        params = sum(p.numel() for p in tiny.model.parameters()) / 1e6
        add(
            "forge fp32 tiny", tiny, args.steps, "forge", "fp32", "plain fp32 tiny",
            f"{' '.join(TINY)} ({params:.2f} M parameters)", onednn,
        )  # fmt: skip
        add(
            "plain fp32 tiny", PlainSide(tiny, tiny.fresh_batches(blocks * args.steps)), args.steps, "plain", "fp32",
            "plain fp32 tiny", "the plain loop on that model (no logging: it prints nothing)", mkl, tiny.step_flops,
        )  # fmt: skip
    # Larger models: the same config with a wider model (about 4x and 16x the parameters), so
    # the overhead's growth with size shows. Fewer steps per block keep the rounds short.
    for label, (dim, heads, divisor) in GROWN.items():
        if label not in args.sizes:
            continue
        grown = [f"--model.dim={dim}", f"--model.n_heads={heads}"]
        side = forge(f"fp32-{label}", ["--train.precision=fp32", *grown])
        steps = max(1, args.steps // divisor)
        params = sum(p.numel() for p in side.model.parameters()) / 1e6
        add(
            f"forge fp32 {label}", side, steps, "forge", "fp32", f"plain fp32 {label}",
            f"dim {dim}, {heads} heads ({params:.1f} M parameters)", onednn,
        )  # fmt: skip
        add(
            f"plain fp32 {label}", PlainSide(side, side.fresh_batches(blocks * steps)), steps, "plain", "fp32",
            f"plain fp32 {label}", "the plain loop on that model", mkl, side.step_flops,
        )  # fmt: skip
    bf16_batch = args.bf16_batch or (
        max(1, fp32.config.train.batch_size // 4) if bf16_slow else fp32.config.train.batch_size
    )
    if not args.no_bf16:
        bf16 = forge("bf16", ["--train.precision=bf16", f"--train.batch_size={bf16_batch}"])
        how = f"--train.precision=bf16, batch {bf16_batch}"
        add("forge bf16", bf16, bf16_steps, "forge", "bf16", "plain bf16", how, bf16_kernel)
        add(
            "plain bf16", PlainSide(bf16, bf16.fresh_batches(blocks * bf16_steps)), bf16_steps, "plain", "bf16",
            "plain bf16",
            f"torch.autocast bf16, batch {bf16_batch}", bf16_kernel, bf16.step_flops,
        )  # fmt: skip
    if args.compile:
        compiled = forge("fp32-compile", ["--train.precision=fp32", "--train.compile=true"])
        add(
            "forge fp32 compile", compiled, args.steps, "forge", "fp32", "plain fp32", "--train.compile=true",
            onednn + ", compiled blocks",
        )  # fmt: skip
        add(
            "plain fp32 compile", PlainSide(fp32, batches, compile_model=True), args.steps, "plain", "fp32",
            "plain fp32", "torch.compile(model)", "inductor (extern mm: MKL sgemm)", fp32.step_flops,
        )  # fmt: skip
        if not args.no_bf16:  # the fastest bf16 step Forge offers: inductor fuses the elementwise work
            bf16_compiled = forge(
                "bf16-compile", ["--train.precision=bf16", f"--train.batch_size={bf16_batch}", "--train.compile=true"]
            )
            add(
                "forge bf16 compile", bf16_compiled, bf16_steps, "forge", "bf16", "plain bf16",
                f"--train.precision=bf16 --train.compile=true, batch {bf16_batch}", bf16_kernel + ", compiled blocks",
            )  # fmt: skip

    first_block_s: dict[str, float] = {}  # wall time of each side's first block (compilation included)

    def runner(name: str) -> Callable[[], float]:
        steps = plans[name]["steps"]
        if sides[name] is None:
            return lambda: train_end_to_end([*base, "--train.precision=fp32"], steps, settings)

        def run() -> float:
            start = time.perf_counter()
            tokens_per_s = sides[name].run(steps)
            first_block_s.setdefault(name, time.perf_counter() - start)
            return tokens_per_s

        return run

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

    cfg = fp32.config

    medians = {name: median(values) for name, values in samples.items()}
    rows = []
    for name, plan in plans.items():
        flops = plan["flops"] * medians[name]
        peak_theory = theoretical[plan["precision"]][0]
        rows.append(
            {
                "variant": name,
                "tokens_per_s": medians[name],
                "min": min(samples[name]),
                "max": max(samples[name]),
                "baseline": plan["baseline"],
                "x_baseline": medians[name] / medians[plan["baseline"]],
                "x_forge_fp32": medians[name] / medians["forge fp32"],
                "mfu_measured_peak": flops / best[plan["precision"]],
                "mfu_theoretical_peak": flops / peak_theory if peak_theory else None,
                "linear_kernel": plan["linear"],
                "how": plan["how"],
            }
        )
    for row in rows:
        print(
            f"{row['variant']:26s} {row['tokens_per_s']:9.0f} tok/s  x{row['x_baseline']:.3f} vs {row['baseline']:18s}"
            f" x{row['x_forge_fp32']:.3f} vs forge fp32  MFU {100 * row['mfu_measured_peak']:.1f}%"
        )

    same = []
    for forge_name, plain_name in (("forge fp32", "plain fp32"), ("forge bf16", "plain bf16")):
        if forge_name in sides and sides[forge_name].first and sides[plain_name].first:
            (fl, fg), (pl, pg) = sides[forge_name].first, sides[plain_name].first
            same.append(f"{forge_name}: loss {fl:.6f} vs {pl:.6f}, grad norm {fg:.6f} vs {pg:.6f}")
    print("first step, same weights and batch: " + "; ".join(same))

    cached = cpu_peak_flops(torch.float32) if fp32.device.type == "cpu" else fp32.peak
    model = cfg.model.options
    has = [flag for flag in ("avx512f", "avx512_bf16", "amx_bf16") if features.get(flag)]
    sentences = [
        f"CPU: {features.get('model', 'unknown')}, with {', '.join(has) or 'none of avx512f, avx512_bf16, amx_bf16'}"
        f" ({'bf16 matrix instructions' if {'avx512_bf16', 'amx_bf16'} & set(has) else 'no bf16 matrix unit'}).",
        f"Default model ({model.n_layers} layers, dim {model.dim}, {model.n_heads} heads, "
        f"{sum(p.numel() for p in fp32.model.parameters()) / 1e6:.2f} M parameters, "
        f"{fp32.step_flops / 1e6:.1f} MFLOP per token), batch {cfg.train.batch_size} x seq "
        f"{cfg.train.seq_len} = {fp32.tokens_per_step} tokens per step, device {fp32.device}; the 4x and 16x rows "
        "widen it (same layers, batch and data).",
        f"Medians of {args.rounds} alternating rounds after {args.warmup} warm-up round(s); a round runs "
        f"{args.steps} steps of each default-size variant (fewer for the larger models; {bf16_steps} of batch "
        f"{bf16_batch} for bf16).",
        "`x_baseline`: tokens/s over the baseline's, a plain loop on the same model (1.0 = Forge costs nothing "
        "over a hand-written loop); `x_forge_fp32`: over Forge's default. `linear_kernel`: the kernel the "
        "model's linear layers took.",
        "MFU = the row's model FLOP per token x tokens/s over a peak: `mfu_measured_peak` over the best measured "
        f"matmul rate of the row's dtype (fp32 {best['fp32'] / 1e9:.1f}, bf16 {best['bf16'] / 1e9:.1f} GFLOP/s, "
        "best kernel per dtype in the matmul table, or in fp32 the best of the layer's products), "
        "`mfu_theoretical_peak` over cores x boost clock x FLOP per "
        "cycle ("
        + "; ".join(f"{name}: {peak / 1e9:.1f} GFLOP/s" if peak else f"{name}: none, {why}"
                    for name, (peak, why) in theoretical.items())
        + f"). Forge's own MFU metric uses its cached fp32 peak ({cached / 1e9:.1f} GFLOP/s).",
        "Attention: Forge's rows take what `[model] attention_backend = \"auto\"` picks on this device "
        f"(on CPU eager attention up to {EAGER_MAX_KEYS[torch.float32]} keys, {EAGER_MAX_KEYS[torch.bfloat16]} in "
        "bf16, as at this model's sequence length; the attention table), the plain loop's "
        "`F.scaled_dot_product_attention`, as a hand-written model calls it.",
        "Memory: Forge's CPU runs keep freed memory in the process "
        f"(forge_lm.train.cpu_memory: {fp32.parts.cpu_memory}); the setting is process-wide, so the plain "
        "loop's rows, run in the same process, have it too.",
        "Same work: first step from the same weights and batch, " + ("; ".join(same) or "not checked") + " "
        "(Forge's oneDNN products and the plain loop's MKL ones differ in the last bits).",
    ]  # fmt: skip
    if bf16_slow and not args.no_bf16:
        sentences.append(
            f"bf16 has no fast matmul on this CPU (best bf16 kernel {best['bf16'] / 1e9:.2f} GFLOP/s vs fp32 "
            f"{best['fp32'] / 1e9:.1f}): bf16 autocast is a GPU speed-up, not a CPU one; the bf16 rows run a "
            f"batch of {bf16_batch} to keep the benchmark short (`--bf16-batch` sets it)."
        )
    if not args.compile:
        sentences.append(
            "torch.compile rows: `python benchmarks/bench_train.py --compile` (about a minute of compilation "
            "per model on 2 cores)."
        )
    notes = " ".join(sentences)
    headline = [
        {
            "measure": "Forge training step / plain PyTorch loop, tokens/s (fp32, default model)",
            "value": medians["forge fp32"] / medians["plain fp32"],
            "meaning": "above 1: Forge is faster than a hand-written loop (oneDNN linear layers)",
        },
        {
            "measure": "Forge on the plain loop's kernels (aten linear, SDPA) / plain loop (fp32): the framework's"
            " own overhead",
            "value": medians["forge fp32 plain kernels"] / medians["plain fp32"],
            "meaning": "1.0 = Forge's loop costs nothing over a hand-written one on the same kernels",
        },
    ]
    if "forge fp32 tiny" in medians:
        headline.append(
            {
                "measure": "Forge / plain loop, tokens/s (fp32, tiny model: about 1 M parameters, batch 12 x 64, "
                "logging every step)",
                "value": medians["forge fp32 tiny"] / medians["plain fp32 tiny"],
                "meaning": "target 1.0: the fixed cost per step (hooks, guards, metrics, the one host sync) is most of "
                "a step at this size",
            }
        )
    if "forge fp32 micro" in medians:
        # Seconds per step of each side on the micro model; Forge's extra is its fixed cost per step.
        micro_tokens = sides["forge fp32 micro"].tokens_per_step
        forge_micro_s, plain_micro_s = (micro_tokens / medians[f"{side} fp32 micro"] for side in ("forge", "plain"))
        fixed_s = forge_micro_s - plain_micro_s
        headline.append(
            {
                "measure": "Forge's fixed cost per step over the plain loop's (ms; a model of one width-16 block, 16 "
                "tokens a step, logging every step)",
                "value": fixed_s * 1e3,
                "meaning": f"the loop's own work per step: Forge's step {forge_micro_s * 1e3:.2f} ms against the plain "
                f"loop's {plain_micro_s * 1e3:.2f} ms",
            }
        )
        for name, label in (("forge fp32", "default model"), ("forge fp32 tiny", "tiny model")):
            if name in medians:
                step_s = sides[name].tokens_per_step / medians[name]
                headline.append(
                    {
                        "measure": f"that fixed cost as a share of Forge's step (fp32, {label})",
                        "value": fixed_s / step_s,
                        "meaning": f"target at most 0.01 (issue 35); the step takes {step_s * 1e3:.1f} ms",
                    }
                )
    for label in ("4x", "16x"):
        if f"forge fp32 {label}" in medians:
            headline.append(
                {
                    "measure": f"Forge / plain loop, tokens/s (fp32, {label} the default model's parameters)",
                    "value": medians[f"forge fp32 {label}"] / medians[f"plain fp32 {label}"],
                    "meaning": "the same ratio on a larger model",
                }
            )
    headline.append(
        {
            "measure": "Forge training step, MFU of the measured fp32 matmul peak",
            "value": fp32.step_flops * medians["forge fp32"] / best["fp32"],
            "meaning": "fraction of the best fp32 product on this machine (oneDNN's)",
        }
    )
    if "forge train() fp32" in medians:
        headline.append(
            {
                "measure": "`forge_lm.train.train()` (whole loop) / plain PyTorch loop, tokens/s (fp32)",
                "value": medians["forge train() fp32"] / medians["plain fp32"],
                "meaning": "the loop as `forge train` runs it",
            }
        )
    if "forge fp32 compile" in medians:
        headline.append(
            {
                "measure": "Forge with train.compile / plain PyTorch loop, tokens/s (fp32)",
                "value": medians["forge fp32 compile"] / medians["plain fp32"],
                "meaning": "the fastest options Forge offers against the uncompiled hand-written loop",
            }
        )
    if "forge fp32 compile" in medians:
        # What compiling costs before the first step: the compiled side's first block over its
        # steady-state time for those steps, and how many steps the measured gain needs to repay it.
        steps = plans["forge fp32 compile"]["steps"]
        step_s = {name: fp32.tokens_per_step / medians[name] for name in ("forge fp32", "forge fp32 compile")}
        startup_s = first_block_s["forge fp32 compile"] - steps * step_s["forge fp32 compile"]
        saved_per_step = step_s["forge fp32"] - step_s["forge fp32 compile"]
        repaid = f"repaid after about {startup_s / saved_per_step:.0f} steps" if saved_per_step > 0 else "never repaid"
        headline.append(
            {
                "measure": "`train.compile` start-up: compiling the default model's blocks before its first step, "
                "empty inductor cache (s)",
                "value": startup_s,
                "meaning": f"{repaid} at the measured gain over the uncompiled step; hence opt-in",
            }
        )
    if "forge bf16" in medians:
        headline.append(
            {
                "measure": "Forge bf16 step, MFU of the measured bf16 matmul peak",
                "value": bf16.step_flops * medians["forge bf16"] / best["bf16"],
                "meaning": "target 0.45 on a CPU with bf16 matrix units"
                + ("" if {"avx512_bf16", "amx_bf16"} & set(has) else " (this CPU has none)"),
            }
        )
    if "forge bf16 compile" in medians:
        headline.append(
            {
                "measure": "Forge bf16 step with train.compile, MFU of the measured bf16 matmul peak",
                "value": bf16.step_flops * medians["forge bf16 compile"] / best["bf16"],
                "meaning": "the same, with the elementwise work between the products fused by inductor",
            }
        )
    command = "python benchmarks/bench_train.py " + " ".join(sys.argv[1:])
    if not args.no_save:
        tables = {
            "matmul peak (best of 7 per kernel and size)": peaks,
            "each model's first feed-forward projection, fp32: MKL (F.linear) vs oneDNN (Forge), best of 5": products,
            f"attention forward + backward, {attention_tokens} tokens per batch, the default model's heads, three "
            "documents per row: SDPA (dense mask) vs eager (additive mask), best of 5; x_sdpa = SDPA's time over "
            "eager's": attention_rows,
        }
        path = save("train", command.strip(), rows, notes, tables=tables, headline=headline)
        print(f"wrote {path}")
    shutil.rmtree(workdir, ignore_errors=True)


def _has_component(settings: PluginSettings, category: str, name: str) -> bool:
    """Whether an installed (and allowed) plugin registers ``name`` in ``category``."""
    try:
        PluginManager(settings).registry.resolve(category, name)
    except Exception:  # noqa: BLE001 - not installed, disabled or broken: the row is left out
        return False
    return True


def swiglu_hidden_of(config: Any) -> int:
    """The hidden width of the default feed-forward (SwiGLU) of ``config``'s model."""
    options = config.model.options.ffn.options
    return swiglu_hidden(config.model.options.dim, options.hidden_multiplier, options.multiple_of)


if __name__ == "__main__":
    main()
