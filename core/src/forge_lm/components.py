"""The contracts between the core and the components plugins register.

Each category's factory signature is documented on its registration hook in
:mod:`forge_lm.hookspecs`; the objects passed to factories, and the protocols of the objects
they return, are defined here. This module imports no torch, so plugin modules may import
it freely (for example to subclass :class:`WarmupOptions`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs

from forge_lm.validators import non_negative, positive

IGNORE_INDEX = -100
"""Label value of positions that carry no loss (padding, document boundaries)."""


@attrs.frozen
class DataContext:
    """What a dataset factory needs to know about the run."""

    seq_len: int
    vocab_size: int
    dp_rank: int = 0  # this process's index among data-parallel ranks
    dp_size: int = 1  # data-parallel ranks: each must get a distinct slice of the data
    seed: int = 0
    split: str = "train"  # "train", or "eval" for the held-out split the dataset defines
    tokenizer: Any = None  # a Tokenizer, for datasets that read text
    registry: Any = None  # the component registry, for datasets that compose others (a mixture)
    model: Any = None  # the [model] section's options (the family's), for data the model shapes (image tokens)


@attrs.frozen
class MetricsContext:
    """What a metrics backend factory needs to know about the run."""

    run_dir: Path
    run_name: str = "forge"
    total_steps: int = 0  # the run's max_steps, for progress displays (0: unknown)


@runtime_checkable
class EvalData(Protocol):
    """One evaluation set of a run, as the run's own evaluation reads it (an
    :class:`EvaluatorContext` gives them): this rank's slice of the same batches every call."""

    prefix: str  # where the run logs its loss: "eval" ([data]'s held-out split) or "eval/<set name>"
    steps: int  # the batches an evaluation reads

    def batches(self) -> Iterator[Mapping[str, Any]]:
        """The ``steps`` batches, on the run's device: input_ids, labels, document_ids and any
        inputs the dataset adds (pixel_values), as the training step gets them."""
        ...


def call_model(model: Any, batch: Mapping[str, Any]) -> Any:
    """The model's logits for ``batch``, called as the run calls it in one process: the token ids,
    the document ids (packed documents do not attend to each other) and the batch inputs the model
    declares (:func:`batch_inputs`)."""
    return model(batch["input_ids"], batch.get("document_ids"), **batch_inputs(model, batch))


def _no_autocast() -> Any:
    import contextlib

    return contextlib.nullcontext()


@attrs.frozen
class EvaluatorContext:
    """What an evaluator factory needs to know about the run: everything to evaluate the live
    model on the run's own data, so an evaluator never reads the run's ``config.toml``."""

    run_dir: Path
    tokenizer: Any  # the run's Tokenizer: text in, the model's ids out
    vocab_size: int
    seq_len: int  # the training sequence length
    max_seq_len: int  # the longest sequence the model accepts
    batch_size: int  # the training micro-batch: a size known to fit
    device: Any  # torch.device of this rank's model
    dtype: Any  # autocast dtype of the run (torch.bfloat16), or None for fp32
    rank: int = 0
    world_size: int = 1
    validation: EvalData | None = None  # [data]'s held-out split, when the run evaluates it (no [eval.datasets])
    eval_sets: Mapping[str, EvalData] = attrs.field(factory=dict)  # [eval.datasets], by set name
    autocast: Any = _no_autocast  # autocast(): the run's torch.autocast context for a forward pass
    call_model: Any = call_model  # call_model(model, batch) -> logits, as the run calls the model


@attrs.frozen
class ModelContext:
    """What a model family's factory needs besides its options."""

    vocab_size: int  # [model] vocab_size, or the tokenizer's
    registry: Any  # the component registry, to build the components its options select (ffn, attention)


@attrs.frozen
class AttentionSpec:
    """The sizes an attention factory builds to, taken from the model family's options."""

    dim: int  # the residual stream's width: the layer maps [batch, seq, dim] to the same shape
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float = 1e-5
    qk_norm: bool = False
    backend: str = "auto"  # [model] attention_backend: how the model's masks are applied


@attrs.define
class WarmupOptions:
    """Base class for scheduler options: linear warmup over the first ``warmup_steps`` steps."""

    warmup_steps: int = attrs.field(default=0, validator=non_negative)


@attrs.define
class LearningRateOptions:
    """Base class for optimizer options that take a learning rate."""

    lr: float = attrs.field(default=3e-4, validator=positive)


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back. ``encode(text)`` gives the ids of the text alone: it adds no
    end-of-text id (nor any other special id: datasets place ``eos_id`` between documents
    themselves), and ``encode("")`` is ``[]``. ``decode(ids)`` gives no text for ``eos_id`` or
    another special id (a packed sequence decodes to its documents' texts joined); an id outside
    ``[0, vocab_size)`` is the caller's error, and what decode does with it is the tokenizer's
    choice (the built-in ones leave it out). A lossless tokenizer round-trips every string,
    control characters and every Unicode plane included (the conformance kit checks all this)."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class StatefulDataset(Protocol):
    """An iterable of samples whose position can be saved and restored exactly."""

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class SavesLocalState(Protocol):
    """A dataset whose ``state_dict()`` talks to other ranks (a collective), and which also gives
    this rank's position without one: a loader reading ahead in a background thread notes
    ``local_state_dict()`` per batch, and ``load_state_dict`` restores it on the same rank."""

    def local_state_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class ReadsBatches(Protocol):
    """A dataset that reads a whole batch at once, faster than sample by sample (plugin API 1.4).

    ``read_batch(size)`` returns what ``size`` draws of the dataset's iterator would, stacked as
    the loader stacks them: a dict of tensors ``[size, *sample_shape]``, the same keys, values and
    dtypes; None where the iterator would end first (a finite dataset: its incomplete last batch
    is dropped). It advances the dataset as those draws would, so its ``state_dict()`` afterwards
    is the state after ``size`` samples. The loader then calls it instead of the iterator; it
    checks what comes back as it checks any batch."""

    def read_batch(self, size: int) -> Mapping[str, Any] | None: ...


@runtime_checkable
class Scheduler(Protocol):
    """A learning-rate scheduler (a torch ``LRScheduler`` is one): ``step()`` once per optimizer
    step, its position saved and restored with the checkpoint."""

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class EvolvingGroupKeys(Protocol):
    """An optimizer whose parameter groups carry values that change as training goes on (a step
    count, an averaging weight) besides ``lr``, ``initial_lr`` and schedule-free AdamW's ``step``
    and ``lr_sq_sum``: a resumed run restores these keys from the checkpoint, and takes every
    other group value (a setting) from the optimizer built from its config."""

    evolving_group_keys: tuple[str, ...]  # keys present in every parameter group


@runtime_checkable
class DeclaresOptimizerStates(Protocol):
    """An optimizer's options class that says how many state tensors, each the size of its
    parameter, the optimizer keeps per parameter (AdamW's ``exp_avg`` and ``exp_avg_sq``: 2), for
    the memory estimate; an upper bound where it varies by parameter. Checked on the class::

        @attrs.define
        class MyOptions(LearningRateOptions):
            FORGE_LM_OPTIMIZER_STATES: ClassVar[float] = 2
    """

    FORGE_LM_OPTIMIZER_STATES: ClassVar[float]


@runtime_checkable
class Evaluator(Protocol):
    """Runs at each evaluation of a training run (``eval.interval``, and at the end)."""

    def evaluate(self, model: Any, step: int) -> Mapping[str, float]:
        """Evaluate ``model`` after optimizer step ``step``; return metrics to log (named
        ``eval/<task>/<metric>`` by convention), or an empty mapping to skip this time.

        Called on every rank, with the model in eval mode under ``torch.no_grad()``. The model
        may be sharded (FSDP2, tensor parallel): every rank must make the same forward calls
        on the same inputs, in the same order, so the evaluator does not split its work
        across ranks. Rank 0's metrics are logged; values that are not numbers are left out
        with a warning."""


@runtime_checkable
class ReportsResults(Protocol):
    """An evaluator that keeps the full results of its last ``evaluate`` call besides the metrics
    it returns: ``results``, plain data a JSON file can hold (None before the first call), and
    ``table``, the same results as text for a terminal. ``forge eval`` writes and prints them."""

    results: Mapping[str, Any] | None
    table: str


@runtime_checkable
class EvaluationPointOptimizer(Protocol):
    """An optimizer whose weights for evaluation differ from those it trains (schedule-free
    methods evaluate at an average of the iterates). The training loop calls ``eval()`` before
    every evaluation and ``train()`` after it; an optimizer without both methods is left alone."""

    def eval(self) -> None:
        """Swap the evaluation weights into the model's parameters."""

    def train(self) -> None:
        """Swap the training weights back."""


@runtime_checkable
class MetricsBackend(Protocol):
    """Receives metrics on the rank that logs (rank 0)."""

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        """Called once before the first step with the resolved config (plain data) and plugins."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` at optimizer step ``step``. Must not raise on NaN or Inf values."""

    def finish(self, summary: Mapping[str, float]) -> None:
        """Called once at the end; flush and close. Nothing logged before may be lost."""


@runtime_checkable
class Initializer(Protocol):
    """What a module's ``init_weights(init)`` receives: the way every parameter and buffer of a
    model gets its initial value (:mod:`forge_lm.model.init` implements it).

    Under ``torchrun`` the model is built on the meta device, transformed (tensor, expert and
    data parallelism) and only then given memory, each rank its own shards; a module's
    tensors may then be DTensors holding a part of the whole. ``init`` writes the right part:
    each value depends on the run's seed and the tensor's fully-qualified name only, so every
    layout, and one process, start from the same weights. A module therefore draws nothing
    from torch's global generator and writes no tensor directly; it names its own attributes:

    .. code-block:: python

        def init_weights(self, init):
            init.normal(self.w_in, init.std)
            init.normal(self.w_out, init.residual_std)  # writes into the residual stream
            init.zeros(self.bias)
            init.zeros(self.running_count)  # buffers too: after to_empty they hold garbage
            init.module(self.router)  # a child, by its own init_weights or the default rule

    Every parameter and buffer must be set by some rule; the build names any that is not. A
    feed-forward layer (or any submodule passed to :meth:`module`) without ``init_weights``
    gets the default rule: linear and embedding weights ``normal(0, std)``, biases 0, norm
    scales 1.
    """

    std: float  # [model] init_std
    residual_std: float  # init_std / sqrt(2 * n_layers): projections into the residual stream
    seed: int  # the run's seed

    def normal(self, tensor: Any, std: float, mean: float = 0.0) -> None:
        """Fill ``tensor`` (a parameter or buffer of the model) from ``normal(mean, std)``."""

    def ones(self, tensor: Any) -> None:
        """Fill ``tensor`` with 1."""

    def zeros(self, tensor: Any) -> None:
        """Fill ``tensor`` with 0."""

    def constant(self, tensor: Any, value: float) -> None:
        """Fill ``tensor`` with ``value``."""

    def copy(self, tensor: Any, values: Any) -> None:
        """Set ``tensor`` to ``values``, a whole tensor of its (global) shape computed on any
        device: for values that follow from the config, such as lookup tables. Each rank keeps
        its part; memory for one such tensor is needed briefly on every rank."""

    def module(self, module: Any) -> None:
        """Initialise a child module by its own ``init_weights(init)``, or the default rule."""

    def name_of(self, tensor: Any) -> str:
        """The fully-qualified name of ``tensor`` in the model (``layers.3.feed_forward.w1``)."""


@runtime_checkable
class Command(Protocol):
    """A ``forge`` subcommand a plugin adds (:func:`forge_lm.hookspecs.forge_lm_register_commands`)."""

    def add_arguments(self, parser: Any) -> None:
        """Add the command's arguments to its ``argparse.ArgumentParser``."""

    def run(self, args: Any, plugins: Any) -> int:
        """Run the command with the parsed ``args`` and the loaded plugins; return the exit code."""


# -- capabilities a module may have ---------------------------------------------------------
# The core asks a model's modules for these with isinstance (runtime-checkable: only the
# presence of the member is checked); a module without one gets the core's default behaviour.


@runtime_checkable
class InitializesWeights(Protocol):
    """A module with its own initialisation rule (see :class:`Initializer`); without one it gets
    the default rule."""

    def init_weights(self, init: Initializer) -> None:
        """Set every parameter and buffer of this module through ``init``."""


@runtime_checkable
class CountsActiveParameters(Protocol):
    """A module whose tokens use only some of its parameters (a mixture of experts): MFU and
    the memory estimate count ``active_parameter_count()`` for it instead of all of them, and
    do not look inside it."""

    def active_parameter_count(self) -> int:
        """How many of this module's parameters one token uses."""


@runtime_checkable
class GrowsWeights(Protocol):
    """A module with an axis the core's growth rules cannot know (a mixture of experts: the
    expert axis), grown by ``[checkpoint.growth]`` when ``init_from`` weights fill a larger
    model (:mod:`forge_lm.train.growth`). The core calls it, before its own rules, when a
    tensor of the module differs in shape from the source's; the core's rules then grow what is
    left (wider hidden units, new layers)."""

    def grow_source(
        self, source: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], rules: Any, generator: Any
    ) -> dict[str, Any]:
        """``source``: the source's tensors of this module (names relative to it, full CPU
        tensors); ``shapes``: this module's tensor shapes; ``rules``: the ``[checkpoint.growth]``
        section; ``generator``: a seeded ``torch.Generator`` for any noise. Returns replacements
        for the source tensors this module grows along its own axis (``{name: tensor}``; empty
        when it has nothing to grow). Raises ``ConfigError`` naming the ``[checkpoint.growth]``
        option when the shapes need a rule that is not set, or one that cannot apply."""


@runtime_checkable
class TensorParallelizable(Protocol):
    """A feed-forward layer that ``[distributed] tp > 1`` can split: one without it is refused."""

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """``{submodule name: torch ParallelStyle}``, as ``parallelize_module`` takes it."""


@runtime_checkable
class OwnFSDPUnit(Protocol):
    """A submodule sharded by FSDP2 as a unit of its own, over the named mesh dimensions (expert
    weights over the data-parallel ranks that do not split the experts); others are sharded
    with their transformer block."""

    fsdp_mesh_dims: tuple[str, ...]


# -- what a model family declares ---------------------------------------------------------
# A family's factory returns an nn.Module. The training path, generation and the layouts of
# [distributed] ask it for these capabilities with isinstance; a layout that needs one the
# model lacks is refused when the config is validated (forge config validate), naming the
# family and the capability. Forge's own Transformer (forge_lm.model.Transformer) has all of
# them, so a family that subclasses it keeps them.


@runtime_checkable
class LanguageModel(Protocol):
    """What every model family's module is: ``model(input_ids [B, T], document_ids=None)`` gives
    logits ``[B, T, vocab]`` (``document_ids`` ``[B, T]``: packed documents, a token attends only
    within its own), and ``init_weights(init)`` sets every parameter and buffer through the
    :class:`Initializer` (the model is built on the meta device under ``torchrun``)."""

    def forward(self, input_ids: Any, document_ids: Any = None) -> Any: ...

    def init_weights(self, init: Initializer) -> None: ...


@runtime_checkable
class ShardedByBlocks(Protocol):
    """A model made of repeated blocks: FSDP2 shards each block as a unit, activation
    checkpointing and ``train.compile`` work block by block. Without it FSDP2 shards the model
    as one unit and the per-block transforms are refused."""

    def blocks(self) -> list[Any]:
        """The blocks, in order (a pipeline stage: its own)."""


@runtime_checkable
class WrapsBlocks(Protocol):
    """A model whose blocks another module can wrap in place: forge-vlm's cross-attention layers
    run between a language family's blocks this way. A wrapper is called as the block is (the
    hidden state ``[B, T, dim]`` first, then the family's own arguments) and returns the hidden
    state; it becomes the block (``blocks()`` lists it: FSDP2 and activation checkpointing take
    it as the unit)."""

    def wrap_blocks(self, wrap: Any) -> None:
        """Replace each block ``i`` (its global index) by ``wrap(i, block)``."""


@runtime_checkable
class TensorParallelModel(Protocol):
    """A model ``[distributed] tp > 1`` can split. The plan covers the modules outside the blocks;
    each block's attention and feed-forward must be :class:`TensorParallelizable` too."""

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """``{name of a module outside the blocks: ParallelStyle}`` for the modules this model
        (or pipeline stage) holds."""


@runtime_checkable
class PipelineSplittable(Protocol):
    """A model ``[distributed] pp > 1`` can cut into stages of consecutive blocks."""

    def keep_stage(self, stage: int, stages: int) -> None:
        """Drop, in place, every part that stage ``stage`` of ``stages`` does not hold."""


@runtime_checkable
class ContextParallelModel(Protocol):
    """A model ``[distributed] cp > 1`` can run: ``forward`` takes ``positions`` (a rank's slice
    of each sequence), and :meth:`set_context_parallel` hands the context-parallel group to the
    model's attention layers, which then gather the group's keys and values
    (:class:`ContextParallelAttention`, for Forge's transformer blocks). ``context_parallel`` is
    the group the model was handed (None: it attends within its own tokens).

    ``set_context_parallel`` is part of the protocol from plugin API 1.3; the core no longer walks
    the model's modules, so layers the model holds outside its module tree are told too. A model
    declaring only the ``context_parallel`` attribute (plugin API 1.2's protocol) still runs, with a
    deprecation warning: the core sets the attribute on it and on every submodule that declares
    one, as 1.2 did. Plugin API 2 drops that fallback."""

    context_parallel: Any

    def forward(self, input_ids: Any, document_ids: Any = None, kv_cache: Any = None, positions: Any = None) -> Any: ...

    def set_context_parallel(self, context_parallel: Any) -> None:
        """Attend across ``context_parallel``'s group (None: within this rank's tokens again): set
        ``context_parallel`` on the model and on each of its attention layers. The object has
        ``gather(x, dim)`` (all the attention layers need, differentiable), ``gather_ids(x, dim)``
        (for positions and document ids), ``rank`` and ``size``. Called once, before the model's
        transforms (FSDP2, activation checkpointing); a model that cannot spread it to one of its
        layers raises, naming the layer."""


@runtime_checkable
class GenerationLimits(Protocol):
    """A model that says which prompts it can continue: token ids in ``[0, vocab_size)``, and at
    most ``max_seq_len`` tokens, the prompt and the new ones together. ``forge generate`` refuses
    a prompt outside them with a message instead of an index error deep in the model."""

    vocab_size: int
    max_seq_len: int


@runtime_checkable
class DecodesWithCache(Protocol):
    """A model that generates token by token (``forge generate``, evaluators): ``forward`` takes
    ``kv_cache=`` and continues the tokens cached in it."""

    def new_kv_cache(self, max_len: int | None = None) -> Any:
        """An empty cache for up to ``max_len`` tokens (default the model's longest sequence)."""


@runtime_checkable
class CountsFlops(Protocol):
    """A model that says how much compute a token takes (MFU). Without it Forge counts
    ``6 * active parameters`` per token, leaving attention's scores out."""

    def flops_per_token(self, seq_len: int) -> float:
        """Forward and backward FLOPs of one token in a sequence of ``seq_len`` (its matmuls)."""


@runtime_checkable
class HasParameterRoles(Protocol):
    """A model that names its parameters' roles itself (see :func:`parameter_roles`), for
    parameters the module-based rule would misjudge."""

    def parameter_roles(self) -> dict[str, str]:
        """Each parameter name (as ``named_parameters()`` gives it) mapped to one of :data:`PARAMETER_ROLES`."""


@runtime_checkable
class RotaryAttention(Protocol):
    """An attention layer whose RoPE tables have ``rope_dim`` columns rather than the head size
    (multi-head latent attention rotates only a part of each head)."""

    rope_dim: int


@runtime_checkable
class ContextParallelAttention(Protocol):
    """An attention layer that gathers the keys and values of the context-parallel group when
    ``context_parallel`` is set (None: it attends within its own tokens); of that object it needs
    only ``gather(x, dim)``, every rank's ``x`` concatenated along ``dim`` in rank order,
    differentiably. The model sets it (:meth:`ContextParallelModel.set_context_parallel`; Forge's
    Transformer on each block's attention), and ``[distributed] cp > 1`` is refused for a model
    whose blocks' attention layers do not declare it."""

    context_parallel: Any


@runtime_checkable
class WindowedAttention(Protocol):
    """An attention layer whose queries see only the ``window`` most recent keys (themselves
    included); the model builds its masks with that limit."""

    window: int


@runtime_checkable
class TakesBatchInputs(Protocol):
    """A model whose ``forward`` takes more of a batch than its token ids: ``batch_inputs`` names
    the batch keys (besides ``input_ids``, ``labels``, ``document_ids`` and ``positions``) passed
    as keyword arguments, ``model(input_ids, document_ids, pixel_values=batch["pixel_values"])``,
    by the training loop, the evaluation loss, ``forge generate`` and ``load_pretrained``; a key
    missing from a batch is not passed. Pipeline and context parallelism carry only the token
    ids, and are refused for a model that names any."""

    batch_inputs: tuple[str, ...]


_UNDECLARED = object()


def batch_inputs(model: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``model`` takes from ``batch`` (:class:`TakesBatchInputs`): each name
    it declares that ``batch`` holds; nothing for a model that declares none."""
    return {name: batch[name] for name in declared_batch_inputs(model) if name in batch}


def declared_batch_inputs(model: Any) -> tuple[str, ...]:
    """The names ``model.batch_inputs`` declares, checked: a plugin's model is untrusted."""
    # isinstance(model, TakesBatchInputs) asks exactly this (a protocol of one attribute), but a
    # runtime protocol check costs about 12 us on Python 3.11, and this runs at every forward.
    names = getattr(model, "batch_inputs", _UNDECLARED)
    if names is _UNDECLARED:
        return ()
    if not isinstance(names, tuple | list) or not all(isinstance(name, str) and name for name in names):
        raise TypeError(
            f"{type(model).__name__}.batch_inputs must be a tuple of batch key names (str), got {names!r}; "
            "this is a bug in the model family's plugin."
        )
    reserved = {"input_ids", "labels", "document_ids", "positions"} & set(names)
    if reserved:
        raise TypeError(
            f"{type(model).__name__}.batch_inputs names {sorted(reserved)}, which the core passes itself; "
            "this is a bug in the model family's plugin."
        )
    return tuple(names)


@runtime_checkable
class RunsFromEmbeddings(Protocol):
    """A language model another module can feed embeddings instead of token ids (a vision-language
    model placing image features among the text's): ``embed(input_ids)`` gives the token
    embeddings ``[B, T, dim]`` and ``forward_embeddings(h, document_ids, kv_cache, positions)``
    runs the blocks, final norm and head from them, as ``forward`` does after its embedding."""

    def embed(self, input_ids: Any) -> Any: ...

    def forward_embeddings(
        self, embeddings: Any, document_ids: Any = None, kv_cache: Any = None, positions: Any = None
    ) -> Any: ...


@runtime_checkable
class PromptsWithImages(Protocol):
    """A model ``forge generate --image`` can prompt with images. ``image_prompt(text, images,
    tokenizer, config)`` reads the image files ``images`` (paths) as the run's data reads
    images (``config``: the run's config) and gives ``(prompt token ids, forward keyword
    arguments)``: the ids hold the text's tokens with the image tokens placed where the run's
    data places them, and the arguments carry the images (``{"pixel_values": ...}``), given
    with the prompt's forward. A missing or corrupt image, or markers that do not match the
    images, raise :class:`forge_lm.errors.ForgeError` naming it."""

    def image_prompt(self, text: str, images: Sequence[str], tokenizer: Any, config: Any) -> Any: ...


PARAMETER_ROLES = ("embedding", "output", "norm", "bias", "matrix")
"""The roles :func:`parameter_roles` gives, in the order it decides them."""


def parameter_roles(model: Any) -> dict[str, str]:
    """Each parameter of ``model`` by name (as ``model.named_parameters()`` gives them) mapped to
    its role, for optimizers that treat parameters differently:

    - ``"embedding"``: a parameter of an ``nn.Embedding``, including the shared tensor of an
      output head tied to one (it appears once, under its first name, ``tok_embeddings.weight``);
    - ``"output"``: a weight of the model's output head: ``model.output`` on a Forge model (None
      on a pipeline stage without it), else the module ``model.get_output_embeddings()`` returns;
    - ``"norm"``: a parameter of a normalisation layer (:func:`is_norm_layer`);
    - ``"bias"``: any other parameter with fewer than 2 dimensions (biases, scalar gates);
    - ``"matrix"``: every other parameter (2-D and higher weights: attention and feed-forward
      projections, stacked expert weights, router weights).

    The role comes from the module holding the parameter, never from its name, and Forge's
    transforms (FSDP2, tensor parallelism, activation checkpointing, pipeline stages) keep both
    modules and names, so the result is the same for a whole model, any pipeline stage of it
    and any sharded layout (where parameters are DTensors: only their dimensions are read).
    Frozen parameters are included. Imports torch on call only.
    """
    from torch import nn

    if isinstance(model, HasParameterRoles):
        return dict(model.parameter_roles())
    head = getattr(model, "output", None)
    if not isinstance(head, nn.Module):
        find_head = getattr(model, "get_output_embeddings", None)
        head = find_head() if callable(find_head) else None
    by_id: dict[int, str] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            role = "embedding"
        elif head is not None and module is head:
            role = "output"
        elif is_norm_layer(module):
            role = "norm"
        else:
            continue
        for param in module.parameters(recurse=False):
            if by_id.get(id(param)) != "embedding":  # a tied head's tensor stays an embedding
                by_id[id(param)] = role
    roles = {}
    for name, param in model.named_parameters():
        role = by_id.get(id(param))
        if role == "output" and param.ndim < 2:
            role = "bias"  # a head's bias is a bias
        roles[name] = role or ("bias" if param.ndim < 2 else "matrix")
    return roles


def is_norm_layer(module: Any) -> bool:
    """Whether ``module`` is a normalisation layer: one of torch's (``nn.LayerNorm``,
    ``nn.RMSNorm``, ``nn.GroupNorm``, the batch norms) or a module whose class name ends in
    ``Norm`` (Forge's ``RMSNorm``, Hugging Face's ``LlamaRMSNorm``). The one rule for both the
    default initialisation (scales 1) and :func:`parameter_roles` (``"norm"``), so a layer is
    never a norm to one and a matrix to the other. Imports torch on call only."""
    from torch import nn

    torch_norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    return isinstance(module, torch_norms) or type(module).__name__.endswith("Norm")


def protocol_methods(protocol: type) -> tuple[str, ...]:
    """The methods a protocol of this module declares, in declaration order (its data members
    are not included): what the core checks a plugin's object for (``_contracts.py``)."""
    own = [
        name
        for klass in reversed(protocol.__mro__)
        if klass not in (object, Protocol) and getattr(klass, "_is_protocol", False)
        for name, value in vars(klass).items()
        if callable(value) and (not name.startswith("_") or name == "__iter__")
    ]
    return tuple(dict.fromkeys(own))
