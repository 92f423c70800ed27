"""GPU training throughput, MFU and peak memory of a ~1B dense and an MoE model: Forge against plain PyTorch.

The models (``[model]`` overrides of the default config; data ``python_stdlib``, byte tokens,
in a 32768-id vocabulary so the embedding and head are of a realistic size):

- dense: dim 2048, 16 layers, 16 heads, SwiGLU hidden 5504, vocab 32768 (tied): about 0.88 B
  parameters; seq 2048, batch 8 (16384 tokens per step), bf16 autocast, AdamW.
- MoE (needs the forge-moe plugin; skipped with a message when it is not installed): the same
  with ``[model.ffn] name = "moe"``, 8 experts, top-2, ``expert_multiplier = 0.5``, so a token
  passes through as many feed-forward parameters as in the dense model (about 2.5 B in all),
  experts run by ``torch._grouped_mm`` (``expert_kernel = "grouped_mm"``).

The sides of each model, each built, measured and freed in turn (never two resident: with
``--compile`` the MoE model's three sides and their AdamW states would need about 155 GB):

- ``forge``: Forge's training step, built and stepped as in ``bench_train.py`` (the registry's
  components, ``_train_step``, optimizer and scheduler steps, hooks, metrics);
- ``plain``: a hand-written loop (:class:`PlainLoop`: ``torch.optim.AdamW``, ``F.cross_entropy``,
  ``clip_grad_norm_``) over the same model built from the same seed (so the same initial
  weights) and the same first batches as plain tensors. For the MoE model its MoE layers are
  replaced by :class:`PlainMoE`, a top-k router and ``torch._grouped_mm`` experts written here in
  plain PyTorch over the same weights (no auxiliary loss, no statistics);
- ``plain causal`` (dense only): the plain loop without the per-document attention mask (plain
  causal attention, which lets SDPA use its flash kernel): the mask's cost;
- ``forge compile`` (with ``--compile``): Forge's step with ``train.compile = true`` (the
  warm-up round compiles: a minute or two per model).
- precision and memory (dense only, issue 31): ``forge fp16`` (``[train] precision = "fp16"``,
  float16 autocast with the dynamic loss scale), ``forge activation_offload`` (``[train]
  activation_offload``: saved activations in pinned host memory) and ``forge cpu_offload``
  (``[distributed] cpu_offload``: in this one process FSDP2 over a mesh of one rank, the whole
  model's weights, gradients and optimizer state on the host, the optimizer step on the CPU). Their
  peak memory against ``forge``'s is what offloading saves on the device, their ``steps_per_s``
  what it costs. A side Forge refuses in this one process is not run and its row says why
  (``skipped``, the refusal's message): both offloads on a CPU (nothing to offload to, so in a
  smoke run). ``cpu_offload`` is the dense model's last side: the process group of one rank it
  joins is left before the next model's sides are built, which run without one.

Each side runs ``--warmup`` then ``--rounds`` blocks of ``--steps`` steps; its figure is the
median tokens/s, with the ratio to ``plain``, MFU (``forge_lm.model.flops`` FLOPs per token times
tokens/s) over the GPU's dense bf16 peak in Forge's table (``forge_lm.metrics.gpu_peaks.GPU_PEAKS``)
and over the ``torch.mm`` bf16 rate measured here, its peak memory
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` before its build) and its
first step's loss (``forge`` and ``plain`` start from the same weights and batch: equal losses
mean the same work). A side that fails is recorded with its error and the others still run.

``--output DIR`` writes ``DIR/gpu.json`` (the record ``results/gpu.json`` holds) and ``DIR/gpu.md``
(its table), rewritten after every side so that a session cut short keeps what it measured.
Needs CUDA: without it the script refuses (exit 2). ``--smoke`` runs the same code with tiny
models on the CPU in seconds (bf16 autocast, grouped GEMM experts, the fp16 side, MFU against
the table's H200 entry) to check the script; it never writes ``results/``.

Run:  .venv/bin/python benchmarks/bench_gpu.py --output DIR [--rounds 5 --steps 10] [--no-moe] [--compile]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _gpu_common import SideResult, matmul_peak, measure_in_turn, publish, refuse_without_cuda
from _record import make_record
from bench_train import ForgeSide
from torch import nn

from forge_lm.config import load_config
from forge_lm.data.loader import BatchLoader
from forge_lm.distributed.launch import shutdown_distributed
from forge_lm.distributed.mesh import ParallelDims
from forge_lm.distributed.offload import check_offload
from forge_lm.errors import ConfigError
from forge_lm.metrics.gpu_peaks import gpu_peak_with_source
from forge_lm.model import build_model
from forge_lm.model.flops import active_parameter_count, model_flops_per_token
from forge_lm.model.memory import model_vocab_size
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.builders import build_dataset

DENSE = [
    "--model.dim=2048",
    "--model.n_layers=16",
    "--model.n_heads=16",
    "--model.max_seq_len=2048",
    "--model.vocab_size=32768",
    "--train.seq_len=2048",
    "--train.batch_size=8",
    "--train.precision=bf16",
]
MOE = [
    "--model.ffn.name=moe",
    "--model.ffn.n_experts=8",
    "--model.ffn.top_k=2",
    "--model.ffn.expert_multiplier=0.5",
    "--model.ffn.expert_kernel=grouped_mm",
]
SMOKE = [  # --smoke: the same code paths (bf16 autocast, grouped GEMM experts), tiny
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.max_seq_len=64",
    "--model.vocab_size=512",
    "--train.seq_len=64",
    "--train.batch_size=2",
    "--train.precision=bf16",
]
# Precision and memory: Forge's step on the dense model with one setting changed (issue 31).
VARIANTS = {
    "forge fp16": ["--train.precision=fp16"],
    "forge activation_offload": ["--train.activation_offload=true"],
    "forge cpu_offload": ["--distributed.cpu_offload=true"],
}
SMOKE_GPU = "NVIDIA H200"  # a CPU has no entry in the peak table: a smoke run computes MFU against this one's


# --------------------------------------------------------------------------------------
# The baseline: plain PyTorch
# --------------------------------------------------------------------------------------


class PlainMoE(nn.Module):
    """A mixture of SwiGLU experts in plain PyTorch, over the weights of a forge-moe layer.

    Softmax over the experts in fp32, the top ``top_k``, weights renormalised over them
    (Mixtral); the (token, expert) pairs sorted by expert; each expert's SwiGLU on its rows,
    by ``torch._grouped_mm`` (``kernel="grouped_mm"``) or one matmul per expert (``"loop"``);
    each token's outputs summed with its weights. Weights: ``router`` ``[E, dim]``, ``w1``/``w3``
    ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]`` (``nn.Linear``'s layout per expert).
    """

    def __init__(self, router: nn.Parameter, w1: nn.Parameter, w3: nn.Parameter, w2: nn.Parameter, top_k: int,
                 kernel: str = "grouped_mm") -> None:  # fmt: skip
        super().__init__()
        if kernel not in ("grouped_mm", "loop"):
            raise ValueError(f"PlainMoE kernel must be 'grouped_mm' or 'loop', got {kernel!r}")
        self.router, self.w1, self.w3, self.w2 = router, w1, w3, w2
        self.top_k, self.kernel = top_k, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)  # [T, dim]
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32, as forge-moe's router
            probs = F.linear(flat.float(), self.router.float()).softmax(dim=-1)  # [T, E]
        top, experts = probs.topk(self.top_k, dim=-1)  # [T, k]
        weights = top / top.sum(dim=-1, keepdim=True)
        order = experts.reshape(-1).argsort(stable=True)  # the T*k pairs, grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(experts.reshape(-1), minlength=self.w1.shape[0])
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        rows = flat[tokens].to(dtype)
        w1, w3, w2 = (w.to(dtype) for w in (self.w1, self.w3, self.w2))
        with torch.autocast(x.device.type, enabled=False):  # torch._grouped_mm is not on autocast's lists
            if self.kernel == "grouped_mm":
                offsets = counts.cumsum(0).to(torch.int32)
                hidden = F.silu(torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offsets))
                hidden = hidden * torch._grouped_mm(rows, w3.transpose(-2, -1), offs=offsets)
                y = torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)
            else:
                parts = [
                    F.linear(F.silu(F.linear(r, w1[e])) * F.linear(r, w3[e]), w2[e])
                    for e, r in enumerate(rows.split(counts.tolist()))
                ]
                y = torch.cat(parts)
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = y.new_zeros(flat.shape).index_add(0, tokens, y)
        return out.view(batch, seq, dim)


def use_plain_moe(model: nn.Module, kernel: str = "grouped_mm") -> int:
    """Replace every forge-moe MoE layer of ``model`` by a :class:`PlainMoE` over its weights; how many."""
    from forge_moe.layer import MoELayer
    from forge_moe.routers import SoftmaxTopKRouter

    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, MoELayer)]
    for name, layer in layers:
        router = layer.router
        if not isinstance(router, SoftmaxTopKRouter) or not router.renormalize:
            raise ValueError(f"{name}: PlainMoE implements the renormalised softmax_topk router only")
        if layer.shared is not None or layer.capacity_factor is not None:
            raise ValueError(f"{name}: PlainMoE has no shared experts and no capacity limit; leave both unset")
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        experts = layer.experts
        plain = PlainMoE(router.weight, experts.w1, experts.w3, experts.w2, layer.top_k, kernel)
        setattr(parent, attribute, plain)
    return len(layers)


class PlainLoop:
    """A hand-written training loop over the model a config describes.

    The model is built from the config's seed, so it starts from Forge's initial weights
    (``forge_lm.model.init``: each value depends on the seed and the parameter's name); the
    batches are the first ones Forge's loader hands out, stacked once as plain tensors.
    ``torch.optim.AdamW`` with the config's hyper-parameters and decay groups, ``F.cross_entropy``,
    ``clip_grad_norm_``, the config's precision. ``document_mask=False``: plain causal attention.
    ``plain_moe``: the MoE layers replaced by :class:`PlainMoE` over the same weights.
    """

    def __init__(
        self,
        overrides: list[str],
        workdir: Path,
        settings: PluginSettings,
        *,
        document_mask: bool = True,
        plain_moe: bool = False,
        n_batches: int = 8,
    ) -> None:
        registry = PluginManager(settings).registry
        config = load_config(None, [*overrides, f"--train.output_dir={workdir}"], registry)
        if config.train.precision not in ("bf16", "fp32") or config.train.grad_accum_steps != 1:
            raise ValueError("PlainLoop runs precision bf16 or fp32 with grad_accum_steps = 1")
        self.device = torch.device(config.train.device)
        self.dtype = torch.bfloat16 if config.train.precision == "bf16" else None
        tokenizer = config.tokenizer.build()
        vocab_size = model_vocab_size(config, tokenizer)
        loader = iter(
            BatchLoader(build_dataset(config, registry, tokenizer, vocab_size, "train"), config.train.batch_size)
        )
        batches = [{k: v.to(self.device) for k, v in next(loader).items()} for _ in range(n_batches)]
        self.inputs = [b["input_ids"] for b in batches]
        self.labels = [b["labels"] for b in batches]
        self.documents = [b.get("document_ids") if document_mask else None for b in batches]
        self.model = build_model(config.model, vocab_size, registry, seed=config.train.seed, device=self.device)
        if plain_moe and not use_plain_moe(self.model):
            raise ValueError("plain_moe: the model has no forge-moe MoE layer")
        options = config.optimizer.options
        named = list(self.model.named_parameters())  # a tied head is listed once, as the embedding
        decayed = {n for n, p in named if p.ndim >= 2 and not n.startswith("tok_embeddings.")}
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if n in decayed], "weight_decay": options.weight_decay},
                {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0},
            ],
            lr=options.lr, betas=tuple(options.betas), eps=options.eps,
        )  # fmt: skip
        self.grad_clip = config.train.grad_clip or float("inf")  # 0: no clipping, the norm still computed
        self.tokens_per_step = config.train.batch_size * config.train.seq_len
        self.index = 0
        self.first: tuple[float, float] | None = None

    def run(self, steps: int) -> float:
        """Tokens/s of ``steps`` steps."""
        start = _now(self.device)
        for _ in range(steps):
            i = self.index % len(self.inputs)
            self.index += 1
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                logits = self.model(self.inputs[i], self.documents[i])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), self.labels[i].flatten())
            loss.backward()
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            if self.first is None:
                self.first = (loss.item(), norm.item())
        return self.tokens_per_step * steps / (_now(self.device) - start)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --------------------------------------------------------------------------------------
# The sides of one model
# --------------------------------------------------------------------------------------


def model_info(overrides: list[str], settings: PluginSettings) -> dict[str, Any]:
    """Parameters, active parameters, FLOPs per token and tokens per step of the model of
    ``overrides``, from a build on the meta device (no memory, no side needed)."""
    registry = PluginManager(settings).registry
    config = load_config(None, overrides, registry)
    vocab_size = model_vocab_size(config, config.tokenizer.build())
    model = build_model(config.model, vocab_size, registry, device="meta")
    active = active_parameter_count(model)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "active": active,
        "flops_per_token": model_flops_per_token(model, config.train.seq_len),
        "tokens_per_step": config.train.batch_size * config.train.seq_len * config.train.grad_accum_steps,
    }


def side_builders(
    tag: str, overrides: list[str], settings: PluginSettings, workdir: Path, *, moe: bool, compile_side: bool
) -> dict[str, Callable[[], Any]]:
    """The sides of one model, as builders for :func:`_gpu_common.measure_in_turn`."""

    def forge(name: str, extra: list[str]) -> Callable[[], Any]:
        return functools.partial(_forge_side, [*overrides, *extra], workdir / name, settings)

    builders: dict[str, Callable[[], Any]] = {
        "forge": forge(f"{tag}-forge", []),
        "plain": lambda: PlainLoop(overrides, workdir / f"{tag}-plain", settings, plain_moe=moe),
    }
    if not moe:  # what the per-document attention mask costs (another semantics: attends across documents)
        builders["plain causal"] = lambda: PlainLoop(
            overrides, workdir / f"{tag}-causal", settings, document_mask=False
        )
    if compile_side:
        builders["forge compile"] = forge(f"{tag}-compile", ["--train.compile=true"])
    return builders


def variant_builders(
    tag: str, overrides: list[str], settings: PluginSettings, workdir: Path
) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """The precision and memory sides of the dense model (:data:`VARIANTS`), as builders, and the
    sides Forge refuses in one process on the overrides' device, each with the refusal's message."""
    registry = PluginManager(settings).registry
    builders: dict[str, Callable[[], Any]] = {}
    skipped: dict[str, str] = {}
    for name, extra in VARIANTS.items():
        config = load_config(None, [*overrides, *extra, f"--train.output_dir={workdir}"], registry)
        try:  # the check forge train makes, for this script's one process
            check_offload(config, torch.device(config.train.device), ParallelDims())
        except ConfigError as refused:
            skipped[name] = str(refused)
            continue
        builders[name] = functools.partial(_forge_side, [*overrides, *extra], workdir / f"{tag}-{name}", settings)
    return builders, skipped


def _forge_side(overrides: list[str], workdir: Path, settings: PluginSettings) -> ForgeSide:
    # No copy for bench_train's plain loop (PlainLoop builds its own): it would count in the side's peak memory.
    return ForgeSide(overrides, workdir, settings, plain_copy=False)


def rows_for(
    label: str,
    info: dict[str, Any],
    results: dict[str, SideResult],
    peaks: dict[str, float],
    skipped: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One row per side measured, then one per side ``skipped`` (its reason, no numbers)."""
    plain = results.get("plain")
    plain_rate = plain.tokens_per_s if plain else None
    rows = []
    for name, result in results.items():
        rate = result.tokens_per_s
        row: dict[str, Any] = {
            "model": label,
            "side": name,
            "tokens_per_s": rate,
            "steps_per_s": rate / info["tokens_per_step"] if rate else None,
            "x_plain": rate / plain_rate if rate and plain_rate else None,
            "mfu_table_peak": info["flops_per_token"] * rate / peaks["table"] if rate else None,
            "mfu_measured_peak": info["flops_per_token"] * rate / peaks["measured"] if rate else None,
            "peak_memory_gib": result.peak_memory_gib,
            "first_step_loss": result.first_step_loss,
            "build_s": result.build_s,
            "params_b": info["params"] / 1e9,
            "active_params_b": info["active"] / 1e9,
            "tokens_per_step": info["tokens_per_step"],
        }
        if result.error:
            row["error"] = result.error
        rows.append(row)
    for name, reason in (skipped or {}).items():
        rows.append({"model": label, "side": name, "tokens_per_s": None, "steps_per_s": None, "skipped": reason})
    return rows


# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before the timed ones (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per round")
    parser.add_argument("--no-moe", action="store_true", help="only the dense model")
    parser.add_argument("--compile", action="store_true", help="add a train.compile = true side per model")
    parser.add_argument("--output", type=Path, metavar="DIR", help="write gpu.json and gpu.md here (after every side)")
    parser.add_argument(
        "--smoke", "--smoke-cpu", action="store_true", help="tiny models on the CPU: checks the script in seconds"
    )
    parser.add_argument("--no-save", action="store_true", help="do not write results/gpu.json (--output still is)")
    args = parser.parse_args(argv)
    if not args.smoke and (refused := refuse_without_cuda("bench_gpu.py", "one NVIDIA GPU")) is not None:
        return refused
    if args.smoke:
        args.rounds, args.warmup, args.steps = min(args.rounds, 2), 0, 2
    device = torch.device("cpu" if args.smoke else "cuda")

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        print(f"GPU: {gpu}; measuring torch.mm bf16 ...", flush=True)
        mm = {size: matmul_peak(device, torch.bfloat16, size, 20) for size in (4096, 8192)}
    else:
        gpu = SMOKE_GPU
        mm = {size: matmul_peak(device, torch.bfloat16, size, 2) for size in (128, 256)}
    for size, value in mm.items():
        print(f"  {size:5d}: {value / 1e12:8.3f} TFLOP/s", flush=True)
    peaks = {"measured": max(mm.values())}
    try:
        peaks["table"], peak_source = gpu_peak_with_source(gpu, "bf16")
    except ConfigError:  # not in Forge's table: MFU against the measured rate instead
        peaks["table"], peak_source = peaks["measured"], f"{gpu} is not in Forge's table: the measured torch.mm rate"
    print(f"peak for MFU: {peaks['table'] / 1e12:.1f} TFLOP/s ({peak_source})", flush=True)

    settings = PluginSettings.from_env()
    # Forge's own MFU metric uses the same peak (and a smoke run does not measure the CPU's).
    dense = [
        f"--train.device={device.type}",
        *(SMOKE if args.smoke else DENSE),
        f"--metrics.peak_flops={peaks['table']}",
    ]
    models = {"dense (smoke)" if args.smoke else "dense ~0.9B": dense}
    left_out = ""
    if args.no_moe:
        left_out = " MoE left out (--no-moe)."
    elif importlib.util.find_spec("forge_moe") is None:
        left_out = " MoE skipped: the forge-moe plugin is not installed (pip install forge-moe)."
        print("skipping the MoE model: the forge-moe plugin is not installed (pip install forge-moe)", flush=True)
    else:
        models["MoE (smoke)" if args.smoke else "MoE 8 experts top-2"] = [*dense, *MOE]

    command = ("python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    notes = _notes(args, gpu, peak_source, peaks) + left_out
    tables = {"torch.mm bf16": [{"size": s, "tflop_per_s": v / 1e12} for s, v in mm.items()]}
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-gpu-"))
    try:
        for index, (label, overrides) in enumerate(models.items()):
            info = model_info(overrides, settings)
            print(
                f"{label}: {info['params'] / 1e6:.2f} M parameters ({info['active'] / 1e6:.2f} M active per token), "
                f"{info['tokens_per_step']} tokens per step, {info['flops_per_token'] / 1e9:.3f} GFLOP per token",
                flush=True,
            )
            moe = label.startswith("MoE")
            builders = side_builders(f"m{index}", overrides, settings, workdir, moe=moe, compile_side=args.compile)
            skipped: dict[str, str] = {}
            if not moe:  # fp16 and offloading, against the forge side's memory and speed
                variants, skipped = variant_builders(f"m{index}", overrides, settings, workdir)
                builders.update(variants)
                for name, reason in skipped.items():
                    print(f"  {name}: skipped: {reason}", flush=True)
            # After every side, what is measured so far goes to --output: a session cut short keeps it.
            so_far = make_record("gpu", command, list(rows), notes + " (partial)", tables=tables)
            write = functools.partial(_write_partial, args.output, so_far, label, info, peaks, skipped)
            results = measure_in_turn(
                builders,
                rounds=args.rounds,
                warmup=args.warmup,
                steps=args.steps,
                device=device,
                after_each=write if args.output is not None else None,
            )
            rows += rows_for(label, info, results, peaks, skipped)
            # The group of one rank the cpu_offload side joined (FSDP2 in one process) is not the next
            # model's: its sides run as one process without a group. A no-op when none was made.
            shutdown_distributed()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for row in rows:
        if "skipped" in row:
            print(f"{row['model']:20s} {row['side']:14s} skipped (refused in one process on this device)", flush=True)
            continue
        rate = f"{row['tokens_per_s']:10.0f} tok/s" if row["tokens_per_s"] else "    failed     "
        ratio = f"x{row['x_plain']:.3f} of plain" if row["x_plain"] else ""
        mfu = f"MFU {100 * row['mfu_table_peak']:.1f}% of table peak" if row["mfu_table_peak"] else ""
        memory = f"{row['peak_memory_gib']:.1f} GiB peak" if row["peak_memory_gib"] is not None else ""
        print(f"{row['model']:20s} {row['side']:14s} {rate}  {ratio:16s} {mfu:26s} {memory}", flush=True)
    record = make_record("gpu", command, rows, notes, tables=tables, headline=_headline(rows, gpu))
    save_results = not (args.smoke or args.no_save)
    for path in publish(record, args.output, save_results=save_results):
        print(f"wrote {path}")
    print(f"measured in {time.perf_counter() - started:.0f} s")
    if not save_results:
        print("not recorded in results/ (" + ("--smoke" if args.smoke else "--no-save") + ")")
    return 1 if any("error" in row for row in rows) else 0


def _write_partial(
    output: Path, record: dict[str, Any], label: str, info: dict[str, Any], peaks: dict[str, float],
    skipped: dict[str, str], results: dict[str, SideResult],
) -> None:  # fmt: skip
    """``record`` (the models measured before) with this model's sides so far, to ``output``."""
    rows = [*record["rows"], *rows_for(label, info, results, peaks, skipped)]
    publish({**record, "rows": rows}, output, save_results=False)


def _notes(args: argparse.Namespace, gpu: str, peak_source: str, peaks: dict[str, float]) -> str:
    if args.smoke:
        where = (
            f"Smoke run on the CPU, to check the script (numbers not quotable): tiny models `{' '.join(SMOKE)}`, "
            f"MoE adds `{' '.join(MOE)}`; MFU against the {gpu} entry of Forge's table."
        )
    else:
        where = f"One {gpu}. Overrides of the default config: dense `{' '.join(DENSE)}`; MoE adds `{' '.join(MOE)}`."
    return (
        f"{where} Each side built, measured and freed in turn: medians of {args.rounds} rounds after "
        f"{args.warmup} warm-up round(s) of {args.steps} steps. `plain`: a hand-written loop on the same weights "
        "and batches (for MoE, its MoE layers a plain top-k router and torch._grouped_mm experts); `x_plain`: "
        "tokens/s over plain's. MFU: 6 N_active + 12 L d T FLOPs per token (`forge_lm.model.flops`) times "
        f"tokens/s, over {peaks['table'] / 1e12:.0f} TFLOP/s ({peak_source}; `mfu_table_peak`) or the best "
        f"measured torch.mm bf16 rate, {peaks['measured'] / 1e12:.3g} TFLOP/s (`mfu_measured_peak`). "
        "`peak_memory_gib`: torch.cuda.max_memory_allocated from the side's build to its end (null on a CPU). "
        "Precision and memory (dense): `forge fp16` (precision = fp16, its MFU over the same peak: the table's "
        "fp16 rate is its bf16 rate), `forge activation_offload` and `forge cpu_offload`, each forge with that one "
        "setting (cpu_offload: FSDP2 over a mesh of this one rank, the whole model's weights, gradients and "
        "optimizer state on the host); `steps_per_s` = tokens/s over tokens per step; a side Forge refuses in "
        "one process on this device is `skipped` with the refusal (offloading on a CPU). "
        "`first_step_loss`: equal for forge and plain when they did the same work."
    )


def _headline(rows: list[dict[str, Any]], gpu: str) -> list[dict[str, Any]]:
    found = []
    for model, what in (("dense", "~0.9B dense"), ("MoE", "MoE 8x top-2, ~0.9B active")):
        forge = next((r for r in rows if r["model"].startswith(model) and r["side"] == "forge"), None)
        if forge is None or forge["x_plain"] is None:
            continue
        found.append(
            {
                "measure": f"Forge / plain PyTorch, tokens/s, {what}, bf16, one GPU",
                "value": forge["x_plain"],
                "meaning": "1.0 = Forge costs nothing over a hand-written loop",
            }
        )
        found.append(
            {"measure": f"MFU of Forge, {what}, bf16 (of the GPU's table peak)", "value": forge["mfu_table_peak"],
             "meaning": gpu}
        )  # fmt: skip
    return found


if __name__ == "__main__":
    # One side at a time takes most of the GPU's memory: let the next reuse freed blocks.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
