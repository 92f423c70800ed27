"""What a training run needs in memory per rank, estimated from its config before anything is allocated.

``forge train`` checks the estimate before it builds the model (``forge_lm.train.parts.build_parts``)
and ``forge config validate`` prints it: a run that cannot fit its device is refused with a
:class:`~forge_lm.errors.ConfigError` (exit 2) giving the estimate and the limit, in seconds,
instead of growing until the kernel or the CUDA allocator kills it. ``[train] memory_check =
false`` turns the refusal off (the estimate is still printed by ``forge config validate``).

The estimate, per rank:

- **weights**: every parameter once (a tied head is the embedding) at its own dtype (fp32),
  plus the buffers (RoPE tables). The parameters are counted on a model built on torch's meta
  device, which allocates nothing and works for any plugin's feed-forward layer (a mixture of
  experts); at most :data:`MAX_BUILT_LAYERS` blocks are built, further blocks count as the
  smallest built one, so any size is counted in well under a second. Where the model cannot be
  laid out on meta, a lower bound from the config alone (embedding, attention, norms, RoPE
  tables; no feed-forward) stands in.
- **gradients**: one per parameter, at the parameter's dtype.
- **optimizer state**: ``states`` tensors per parameter (AdamW 2, Lion 1, ...); see
  :func:`optimizer_states` for how an optimizer declares its number.
- Weights, gradients and optimizer state are divided by ``dp_shard * tp * pp``: FSDP2 shards
  them over ``dp_shard``, tensor parallelism splits the matrices, pipeline stages hold their own
  layers. Buffers are not divided.
- **activations**, roughly: what backward keeps of one micro-batch (``batch_size * seq_len``
  tokens), :func:`activation_bytes_per_token` per block (measured on the built-in model: about
  22 fp32 values per token and unit of ``dim``), divided by ``tp``, times the blocks a rank
  holds and the micro-batches in flight on a pipeline stage; plus the logits and their gradient.
  Where attention runs eagerly on the run's device (``forge_lm.model.attention.uses_eager``: on
  CPU the ``auto`` backend at short lengths), each block also keeps its heads' ``[T, T]``
  probabilities for backward: ``heads * seq_len`` values per token, in the compute dtype.
  Activation checkpointing keeps the block inputs and one block's activations.

Offloading (:mod:`forge_lm.distributed.offload`) splits the estimate into a device share and a
host share:

- ``[distributed] cpu_offload``: the sharded weights, gradients and optimizer state are on the
  host. The device keeps the buffers and FSDP2's working set: the root unit's parameters
  (everything outside the blocks, gathered for the whole step) and two blocks (the one computed
  and the one prefetched), whole (divided by ``tp`` only), at the compute dtype, each with an
  fp32 gradient: ``(outside_blocks + 2 * largest_block) * (compute bytes + 4) / tp``.
- ``[train] activation_offload``: what the blocks keep for backward is on the host; the device
  keeps one block's activations (the block being computed or differentiated) and the logits.

The limit (:func:`forge_lm.model.available_memory.memory_limit`, which probes this machine): on
CUDA the device's free memory; on CPU the host's available memory, shared by the ranks on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from forge_lm.components import DeclaresOptimizerStates, ShardedByBlocks
from forge_lm.config import ComponentConfig, ForgeConfig, LlamaOptions, ModelSection, model_options
from forge_lm.errors import ConfigError, ForgeError, PluginError
from forge_lm.model.attention import uses_eager
from forge_lm.model.available_memory import (
    MemoryLimit,
    host_memory_limit,
    memory_limit,
    processes_on_host,
    ranks_on_host,
)

if TYPE_CHECKING:
    from forge_lm.distributed.mesh import ParallelDims

MAX_BUILT_LAYERS = 256
"""Blocks built on the meta device to count parameters; more are extrapolated (``exact`` False)."""

OPTIMIZER_STATES_ATTRIBUTE = "FORGE_LM_OPTIMIZER_STATES"
"""Where an optimizer's options class declares how many state tensors, each the size of its parameter,
the optimizer keeps per parameter (:class:`forge_lm.components.DeclaresOptimizerStates`)."""

DEFAULT_OPTIMIZER_STATES = 2.0
"""For an optimizer Forge knows nothing about: Adam's two moments, the most common case."""

_LOGIT_GRADIENT_BYTES = 8  # per logit: the loss's fp32 copy and the fp32 gradient


@attrs.frozen
class ParameterCount:
    """A model's size: ``parameters`` (every tensor once), their bytes, and its buffers' bytes."""

    parameters: int
    parameter_bytes: int
    buffer_bytes: int
    exact: bool  # False: a lower bound, or extrapolated beyond MAX_BUILT_LAYERS blocks
    largest_block: int = 0  # parameters of the largest block (what FSDP2 gathers as one unit)
    outside_blocks: int = 0  # parameters outside the blocks (the embedding, a head, the final norm)


@attrs.frozen
class MemoryEstimate:
    """Bytes one rank needs, by kind; see the module's docstring for what each covers."""

    count: ParameterCount
    optimizer: str
    states: float  # optimizer state tensors per parameter
    shards: int  # dp_shard * tp * pp: what divides weights, gradients and optimizer state
    weights: float
    gradients: float
    optimizer_state: float
    activations: float  # on the device
    working_set: float | None = None  # cpu_offload: the units FSDP2 gathers on the device; None: not offloaded
    host_activations: float = 0.0  # activation_offload: what the blocks keep for backward, on the host

    @property
    def state_offloaded(self) -> bool:
        return self.working_set is not None

    @property
    def total(self) -> float:
        """Bytes on the run's device."""
        if self.working_set is not None:
            return self.count.buffer_bytes + self.working_set + self.activations
        return self.weights + self.gradients + self.optimizer_state + self.activations

    @property
    def host(self) -> float:
        """Bytes offloaded to host memory (0 without offloading)."""
        offloaded = self.weights - self.count.buffer_bytes + self.gradients + self.optimizer_state
        return (offloaded if self.working_set is not None else 0.0) + self.host_activations

    def describe(self) -> str:
        """``3.28M parameters; about 228 MB per rank (weights ..., activations ...)``; with
        offloading, the device's share and the host's."""
        about = "about" if self.count.exact else "at least"
        if not self.host:
            return f"{self.parameters()}; {about} {format_bytes(self.total)} per rank ({self.breakdown()})"
        return (
            f"{self.parameters()}; {about} {format_bytes(self.total)} of device memory per rank "
            f"({self.device_breakdown()}) and {format_bytes(self.host)} of host memory per rank "
            f"({self.host_breakdown()})"
        )

    def device_breakdown(self) -> str:
        if self.working_set is None:
            return self.breakdown()
        return (
            f"buffers {format_bytes(self.count.buffer_bytes)}, gathered layers {format_bytes(self.working_set)}, "
            f"activations {format_bytes(self.activations)}"
        )

    def host_breakdown(self) -> str:
        parts = []
        if self.working_set is not None:
            shards = f", sharded {self.shards} ways" if self.shards > 1 else ""
            parts.append(
                f"weights {format_bytes(self.weights - self.count.buffer_bytes)}, gradients "
                f"{format_bytes(self.gradients)}, optimizer state {format_bytes(self.optimizer_state)} "
                f"({self.optimizer}: {self.states:g} per parameter){shards}: [distributed] cpu_offload"
            )
        if self.host_activations:
            parts.append(f"activations {format_bytes(self.host_activations)}: [train] activation_offload")
        return "; ".join(parts)

    def parameters(self) -> str:
        return f"{'' if self.count.exact else 'at least '}{format_count(self.count.parameters)} parameters"

    def breakdown(self) -> str:
        shards = f", weights sharded {self.shards} ways" if self.shards > 1 else ""
        return (
            f"weights {format_bytes(self.weights)}, gradients {format_bytes(self.gradients)}, optimizer state "
            f"{format_bytes(self.optimizer_state)} ({self.optimizer}: {self.states:g} per parameter), activations "
            f"{format_bytes(self.activations)}{shards}"
        )


def format_bytes(size: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            value = size / scale
            return f"{value:,.0f} {unit}" if value >= 1000 else f"{value:.3g} {unit}"
    return f"{size / 1e3:.3g} kB"


def format_count(n: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:,.0f}{unit}" if value >= 1000 else f"{value:.3g}{unit}"
    return str(n)


# -- parameters ----------------------------------------------------------------------------------


def lower_bound(model: Any, vocab_size: int) -> ParameterCount:
    """The parameters every model of ``model`` (the ``llama`` family's options, or a family's
    options with the same sizes) has whatever its feed-forward layer: embedding, head (if
    untied), attention projections, norm scales; buffers: the RoPE tables. Python integers, so
    any size is counted without overflow or allocation. A family whose options lack those sizes
    gets its embedding alone, or nothing. ``model`` may be the ``[model]`` section itself."""
    if isinstance(model, ComponentConfig):
        model = model.options
    if not isinstance(model, LlamaOptions):
        dim = getattr(model, "dim", None)
        if not isinstance(dim, int):
            return ParameterCount(0, 0, 0, exact=False)
        return ParameterCount(vocab_size * dim, 4 * vocab_size * dim, 0, exact=False, outside_blocks=vocab_size * dim)
    dim, head_dim = model.dim, model.head_size
    q_dim, kv_dim = model.n_heads * head_dim, model.kv_heads * head_dim
    per_block = 2 * dim * q_dim + 2 * dim * kv_dim + 2 * dim  # wq, wo; wk, wv; two norm scales
    if model.qk_norm:
        per_block += 2 * head_dim
    embeddings = vocab_size * dim * (1 if model.tie_embeddings else 2)
    parameters = embeddings + model.n_layers * per_block + dim  # the final norm
    rope = 2 * model.max_seq_len * head_dim * 4  # cos and sin, fp32
    return ParameterCount(
        parameters, 4 * parameters, rope, exact=False, largest_block=per_block, outside_blocks=embeddings + dim
    )


def count_parameters(model: ComponentConfig | ModelSection, vocab_size: int, registry: Any) -> ParameterCount:
    """The parameters of the model :func:`~forge_lm.model.build_model` builds from ``model`` (the
    ``[model]`` section, or the ``llama`` family's options), counted on the meta device: exact
    for up to :data:`MAX_BUILT_LAYERS` blocks of a family whose options have ``n_layers``.
    Raises what building raises (a :class:`ForgeError` from a component; anything else if a
    component cannot be built on meta)."""
    from forge_lm.model.transformer import build_model

    section, total_layers, built = capped_section(model, registry)
    # The meta device allocates nothing; fork_rng keeps the run's seeded generator where it was
    # in case a component draws from it while initialising.
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        meta = build_model(section, vocab_size, registry)
    seen: set[int] = set()

    def size(module: torch.nn.Module) -> tuple[int, int]:
        numel = nbytes = 0
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                numel, nbytes = numel + param.numel(), nbytes + param.numel() * param.element_size()
        return numel, nbytes

    layers = meta.blocks() if isinstance(meta, ShardedByBlocks) else []
    per_layer = [size(layer) for layer in layers]
    rest = size(meta)  # what the blocks do not hold: the embedding (and a tied head, once), the final norm
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
    numel = rest[0] + sum(n for n, _ in per_layer)
    nbytes = rest[1] + sum(b for _, b in per_layer)
    missing = total_layers - built if built is not None else 0
    if missing and layers:
        smallest = min(per_layer)
        numel, nbytes = numel + missing * smallest[0], nbytes + missing * smallest[1]
        layer_buffers = min(sum(b.numel() * b.element_size() for b in layer.buffers()) for layer in layers)
        buffers += missing * layer_buffers
    largest = max((n for n, _ in per_layer), default=0)
    return ParameterCount(numel, nbytes, buffers, exact=not missing, largest_block=largest, outside_blocks=rest[0])


def capped_section(
    model: ComponentConfig | ModelSection, registry: Any
) -> tuple[ComponentConfig, int | None, int | None]:
    """``(section, n_layers, built)``: the ``[model]`` section with at most :data:`MAX_BUILT_LAYERS`
    blocks (for a family whose options have ``n_layers``), what a meta-device build of a model of
    any size takes: the layers asked for, and those built (None when the options have no
    ``n_layers``)."""
    section = model if isinstance(model, ComponentConfig) else ComponentConfig("llama", model)
    options = section.options if section.options is not None else _family_defaults(section, registry)
    total_layers = getattr(options, "n_layers", None)
    if not isinstance(total_layers, int) or isinstance(total_layers, bool):
        return section, None, None
    built = min(total_layers, MAX_BUILT_LAYERS)
    if built != total_layers:
        section = attrs.evolve(section, options=attrs.evolve(options, n_layers=built))
    return section, total_layers, built


def _family_defaults(section: ComponentConfig, registry: Any) -> Any:
    family = section.component if section.component is not None else registry.resolve("models", section.name)
    return family.options_class()


def optimizer_states(component: Any) -> float:
    """State tensors per parameter the optimizer ``component`` keeps: what its options class
    declares in :data:`OPTIMIZER_STATES_ATTRIBUTE` (the built-in optimizers do too), else
    :data:`DEFAULT_OPTIMIZER_STATES`."""
    if not isinstance(component.options_class, DeclaresOptimizerStates):
        return DEFAULT_OPTIMIZER_STATES
    declared = component.options_class.FORGE_LM_OPTIMIZER_STATES
    if isinstance(declared, bool) or not isinstance(declared, int | float) or not 0 <= declared < math.inf:
        raise PluginError(
            f"optimizer '{component.name}' from {component.plugin.label} declares {OPTIMIZER_STATES_ATTRIBUTE} = "
            f"{declared!r}; it must be a number >= 0 (state tensors per parameter). This is a bug in the plugin."
        )
    return float(declared)


# -- the estimate --------------------------------------------------------------------------------


def activation_bytes_per_token(model: Any, autocast: torch.dtype | None) -> int:
    """Bytes one block's backward keeps per token: ``dim * (16 * element + 16)``, 80 per unit of
    ``dim`` in fp32 (measured on the built-in block: 88), 48 in bf16 (the fp32 residual stream,
    norms and RoPE are part of it); a lower estimate for wider feed-forward layers (MoE). 0 for
    a family whose options have no ``dim``."""
    element = 4 if autocast is None else torch.finfo(autocast).bits // 8
    return _size(model, "dim") * (16 * element + 16)


def _size(options: Any, name: str) -> int:
    """A size field of a family's options, or 0 where the family has none of that name."""
    value = getattr(options, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def eager_attention_bytes_per_token(
    config: ForgeConfig, device: torch.device | None, dims: ParallelDims, autocast: torch.dtype | None
) -> int:
    """What one block keeps per token when its attention is eager (:func:`forge_lm.model.attention.uses_eager`
    on ``device``; context parallelism always takes SDPA): every head's probabilities over the
    ``seq_len`` keys, in the compute dtype. 0 otherwise, or when the device is not known."""
    dtype = autocast or torch.float32
    options = model_options(config)
    backend = getattr(options, "attention_backend", "auto")
    if device is None or dims.cp > 1 or not uses_eager(backend, device, config.train.seq_len, dtype):
        return 0
    return _size(options, "n_heads") * config.train.seq_len * torch.finfo(dtype).bits // 8


def estimate_memory(
    config: ForgeConfig,
    vocab_size: int,
    registry: Any,
    dims: ParallelDims,
    autocast: torch.dtype | None,
    device: torch.device | None = None,
) -> MemoryEstimate:
    """The per-rank estimate of the run ``config`` on the layout ``dims``: from the parameters
    counted on the meta device, or from the lower bound (``count.exact`` False) where the model
    cannot be laid out there (a component without meta support, sizes beyond 64-bit tensors)."""
    component = registry.resolve("optimizers", config.optimizer.name)
    states = optimizer_states(component)
    try:
        count = count_parameters(config.model, vocab_size, registry)
    except ForgeError:
        raise
    except Exception:  # noqa: BLE001 - whatever stops the meta build, the lower bound still holds
        count = lower_bound(model_options(config), vocab_size)
    return _estimate(config, vocab_size, count, component.name, states, dims, autocast, device)


def _estimate(
    config: ForgeConfig,
    vocab_size: int,
    count: ParameterCount,
    optimizer: str,
    states: float,
    dims: ParallelDims,
    autocast: torch.dtype | None,
    device: torch.device | None,
) -> MemoryEstimate:
    model, train = model_options(config), config.train
    shards = dims.dp_shard * dims.cp * dims.tp * dims.pp  # FSDP2 shards over dp_shard x cp
    sharded = count.parameter_bytes / shards
    tokens = train.batch_size * train.seq_len // dims.cp  # one micro-batch; a cp rank holds 1 / cp of it
    per_block = (
        activation_bytes_per_token(model, autocast) + eager_attention_bytes_per_token(config, device, dims, autocast)
    ) / dims.tp
    blocks = math.ceil(_size(model, "n_layers") / dims.pp)
    if train.activation_checkpointing == "full":  # block inputs (fp32 residual stream), one block recomputed
        kept = blocks * _size(model, "dim") * 4 / dims.tp + per_block
    elif train.activation_checkpointing == "selective":  # matmul and attention outputs kept, the rest recomputed
        kept = blocks * per_block * 0.6
    else:
        kept = blocks * per_block
    if dims.pp > 1:  # micro-batches whose activations a stage holds at once (the first stage's)
        accum = train.grad_accum_steps
        kept *= min(dims.pp, accum) if dims.pp_schedule == "1f1b" else accum
    element = 4 if autocast is None else torch.finfo(autocast).bits // 8
    logits = vocab_size * (element + _LOGIT_GRADIENT_BYTES)
    host_activations = 0.0
    if train.activation_offload:  # the blocks' saved tensors wait on the host; one block's are on the device
        host_activations, kept = tokens * kept, min(kept, per_block)
    working_set = None
    if config.distributed.cpu_offload:  # the root unit and two blocks gathered, each with an fp32 gradient
        working_set = (count.outside_blocks + 2 * count.largest_block) * (element + 4) / dims.tp
    return MemoryEstimate(
        count=count,
        optimizer=optimizer,
        states=states,
        shards=shards,
        weights=sharded + count.buffer_bytes,
        gradients=sharded,
        optimizer_state=sharded * states,
        activations=tokens * (kept + logits),
        working_set=working_set,
        host_activations=host_activations,
    )


# -- refusing ------------------------------------------------------------------------------------


def refusal(estimate: MemoryEstimate, limit: MemoryLimit) -> str:
    about = "about" if estimate.count.exact else "at least"
    return (
        f"the run needs {about} {format_bytes(estimate.total)} of memory per rank, more than the "
        f"{format_bytes(limit.bytes)} {limit.source}: {estimate.parameters()}; {estimate.device_breakdown()}. Make the "
        "model smaller ([model] "
        "n_layers, dim, vocab_size, max_seq_len, [model.ffn]), lower [train] batch_size or seq_len, set [train] "
        "activation_checkpointing, or shard it over more ranks ([distributed] dp_shard, tp, pp under torchrun); "
        "[train] memory_check = false starts it anyway."
    )


def host_refusal(estimate: MemoryEstimate, limit: MemoryLimit) -> str:
    """The refusal of a run whose offloaded share does not fit in its share of the host's memory."""
    about = "about" if estimate.count.exact else "at least"
    return (
        f"the run offloads {about} {format_bytes(estimate.host)} per rank to host memory, more than the "
        f"{format_bytes(limit.bytes)} {limit.source}: {estimate.parameters()}; {estimate.host_breakdown()}. Shard "
        "it over more ranks ([distributed] dp_shard under torchrun), make the model smaller, or offload less "
        "([distributed] cpu_offload, [train] activation_offload = false); [train] memory_check = false starts it "
        "anyway."
    )


def host_shortfall(estimate: MemoryEstimate, limit: MemoryLimit | None) -> str | None:
    """:func:`host_refusal` when the offloaded share exceeds ``limit`` (the host's, per rank), else None."""
    if not estimate.host or limit is None or estimate.host <= limit.bytes:
        return None
    return host_refusal(estimate, limit)


def loading_shortfall(config: ForgeConfig, vocab_size: int, registry: Any) -> str | None:
    """For a model loaded from files whose sizes nobody has checked (``forge generate`` and
    ``export-hf`` from a run, ``import-hf`` from a Hugging Face directory): what its weights and
    optimizer state need, against this host's available memory, when they do not fit ("needs about
    ... more than the ..."); None when they fit or the host's memory is unknown. The callers refuse
    with it, saying where the sizes came from, before the model's first allocation."""
    from forge_lm.distributed.mesh import ParallelDims  # a single process: nothing is sharded

    estimate = estimate_memory(config, vocab_size, registry, ParallelDims(), None)
    needed = estimate.weights + estimate.optimizer_state
    limit = memory_limit(torch.device("cpu"), processes_on_host=1)
    if limit is None or needed <= limit.bytes:
        return None
    about = "about" if estimate.count.exact else "at least"
    return (
        f"needs {about} {format_bytes(needed)} for its weights and optimizer state, more than the "
        f"{format_bytes(limit.bytes)} {limit.source} ({estimate.parameters()})"
    )


def check_memory(
    config: ForgeConfig,
    vocab_size: int,
    registry: Any,
    dims: ParallelDims,
    device: torch.device,
    autocast: torch.dtype | None,
    agree: Callable[[bool], bool] = bool,
) -> MemoryEstimate | None:
    """Refuse the run (:class:`ConfigError`) if its estimate exceeds this rank's memory; called by
    every rank before anything is built. ``agree`` makes one rank's refusal every rank's, so that
    no rank goes on to wait for the others. Returns the estimate (None with memory_check off)."""
    if not config.train.memory_check:
        return None
    limit = memory_limit(device, processes_on_host=processes_on_host(device))
    estimate = estimate_memory(config, vocab_size, registry, dims, autocast, device)
    problem = refusal(estimate, limit) if limit is not None and estimate.total > limit.bytes else None
    if problem is None and estimate.host:  # offloaded: the host's share, split among this host's ranks
        problem = host_shortfall(estimate, host_memory_limit(ranks_on_host()))
    if agree(problem is not None):
        raise ConfigError(
            problem or "another rank's share of the run does not fit in its memory; see that rank's message."
        )
    return estimate


def model_vocab_size(config: ForgeConfig, tokenizer: Any) -> int:
    """The model's vocabulary: ``[model] vocab_size``, at least the tokenizer's, or the tokenizer's."""
    size = model_options(config).vocab_size
    if size is None:
        return tokenizer.vocab_size
    if size < tokenizer.vocab_size:
        raise ConfigError(
            f"[model] vocab_size: {size} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size}); "
            "raise it or leave it unset to use the tokenizer's."
        )
    return size
