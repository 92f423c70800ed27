"""Every hook a Forge plugin can implement, in one place.

A plugin is a module named by an entry point in the ``forge_lm`` group. It implements hooks
by defining functions with the names below, decorated with :data:`forge_lm.hookimpl`. The
pluggy project name, the entry-point group and the hook prefix are all ``forge_lm``; any
function in a plugin module whose name starts with ``forge_lm_`` but matches no hook here is
rejected, with the plugin named, so a typo never goes silently unused.

Registration hooks receive a ``register`` callback and call it once per component::

    register(name, factory, config=MyOptions, description="One line for list-plugins")

- ``name``: how users select the component in a config (``name = "adamw"``).
- ``factory``: a callable, or a ``"module:attribute"`` string that is imported only when the
  component is built. Plugin modules must not import torch (or any heavy dependency) at
  import time, so factories import lazily; a string is the simplest way to do that.
- ``config``: an attrs class holding the component's options (optional). Its fields are the
  keys allowed in the component's config section, validated and typed by the core. Like the
  factory it may be a ``"module:Class"`` string (plugin API 1.2), imported and checked when a
  config selecting the component is validated or it is built, so that listing plugins imports
  no options module.
- ``description``: one line, shown by ``forge list-plugins``.

The call signature of each category's factory is its contract; the registration hooks below
state it, :mod:`forge_lm.components` spells out the objects involved, and
:mod:`forge_lm.testing` checks that a component honours it.

Lifecycle hooks receive keyword arguments; an implementation may accept any subset of
them (pluggy passes only what it names). The core calls each plugin's implementation on its
own, in pluggy's order (so hook wrappers are not supported: a plugin implementing one is
broken), and treats what a plugin does as untrusted.

When a plugin fails
-------------------

Every message names the plugin, its distribution and version, and the hook:
``plugin 'faults' (forge-faults 1.0) raised in forge_lm_step_end: ValueError: boom``.
"Raises" means any exception, ``SystemExit`` included (a plugin does not decide that the
process ends), and a ``KeyboardInterrupt`` that no Ctrl-C (SIGINT) caused; after a real Ctrl-C
it is the user's (exit 130). A plugin that changes the working directory fails too (it is put
back first): relative paths of the run would point elsewhere.

- A training hook (:func:`forge_lm_train_start`, :func:`forge_lm_step_end`,
  :func:`forge_lm_step_skipped`, :func:`forge_lm_eval_end`, :func:`forge_lm_save_state`,
  :func:`forge_lm_load_state`) that
  raises stops the run with exit code 4. First the step (or evaluation) that finished is
  logged and, unless it is saved already, checkpointed; after a failure in ``save_state``
  or ``load_state`` nothing is saved and the newest checkpoint is the one to resume from.
  The message says where the run stopped, which checkpoint is intact, and to fix the plugin
  or run without it (``--block-plugin NAME``) and run the same command to resume.
- :func:`forge_lm_save_state` returning something a checkpoint cannot keep (anything but
  tensors and plain data) is a failure of the plugin, as if it had raised.
- :func:`forge_lm_step_end` and :func:`forge_lm_eval_end` must return None or a dict of
  metric names (non-empty strings) to numbers (NaN and Inf allowed). Anything else, and keys
  the core logs itself (``loss``, ``lr``, ``step``, ...), is left out with one warning per
  plugin and hook; the run goes on.
- A component the training loop calls into (:mod:`forge_lm.train.guards`): an optimizer's or
  scheduler's ``step()``, a dataset's iterator, a loss, a model family's forward and backward
  with its attention and feed-forward layers, a router inside forge-moe's layers, an evaluator.
  One that raises, ends (a dataset), or returns what the core cannot use (a feed-forward
  output of another shape, a negative learning rate, a sample that is not a dict of int64
  tensors of ``seq_len`` tokens, an evaluator that changed the model's gradients) stops the
  run with exit code 4, the message naming the component with its plugin, distribution and
  version (the core's own component: a bug in forge-lm). The last good step is checkpointed,
  except after an optimizer's or scheduler's ``step()`` that failed (the weights may be half
  updated: the newest checkpoint stands). An evaluator's NaN or Inf metric is logged with one
  warning.
- :func:`forge_lm_train_end` that raises is a warning: after a completed run the exit code
  stays 0, after a failed or interrupted one its own exit code and message stand. Nothing
  raised while the run ends (``train_end``, a backend's ``finish``) replaces the error that
  ended it.
- A metrics backend that raises in ``start``, ``log`` or ``finish`` (an unwritable
  ``metrics.jsonl``, a full disk, a tracker gone away) is turned off with one warning naming
  it and the error; training and the other backends go on. One whose factory raises stops
  the run before anything is written (exit 2).
- :func:`forge_lm_configure` rejects a config with a :class:`forge_lm.errors.ConfigError`;
  anything else it raises is reported as that plugin's bug (exit 2).
- :func:`forge_lm_hf_export` and :func:`forge_lm_hf_import` refuse a model with a
  :class:`forge_lm.errors.ForgeError`, shown as it is; anything else they raise is reported as
  that plugin's bug (exit 4).
- :func:`forge_lm_plot_panels` that raises, or returns anything but a list of
  :class:`forge_lm.metrics.plot_panels.PlotPanel`, stops ``forge plot`` naming the plugin (exit 4).
- A plugin that fails to load is ``broken``, one whose plugin API range excludes this core
  ``incompatible``: ``forge train`` warns about each at start (one line, with the reason)
  and runs without it, unless the config names one of its components (exit 2).
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT_NAME = "forge_lm"
"""The pluggy project name, the entry-point group and the hook prefix (plus ``_``)."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------------------
# Registration: one hook per component category. Called once, when plugins are loaded.
# --------------------------------------------------------------------------------------


@hookspec
def forge_lm_register_optimizers(register: Any) -> None:
    """Register optimizers. Factory: ``factory(options, model) -> torch.optim.Optimizer``.

    ``model`` is the ``torch.nn.Module`` being trained; the optimizer chooses its parameter
    groups from it (names and module types tell a parameter's role). An optimizer that keeps
    a separate evaluation point (schedule-free) defines ``train()`` and ``eval()``; the loop
    calls ``eval()`` before evaluating and ``train()`` after.
    """


@hookspec
def forge_lm_register_schedulers(register: Any) -> None:
    """Register learning-rate schedulers.

    Factory: ``factory(options, optimizer, total_steps) -> torch.optim.lr_scheduler.LRScheduler``.
    A scheduler whose options have ``warmup_steps = W`` warms up linearly: the learning rate
    of the optimizer step with index ``s < W`` is ``base_lr * (s + 1) / W``, so the first step
    never runs at zero.
    """


@hookspec
def forge_lm_register_losses(register: Any) -> None:
    """Register training losses. Factory: ``factory(options) -> loss_fn``.

    ``loss_fn(logits, labels) -> scalar tensor``: logits ``[batch, seq, vocab]``, labels
    ``[batch, seq]`` where :data:`forge_lm.components.IGNORE_INDEX` marks positions that
    carry no loss. The value is a mean over the positions that are not ignored, and it is the
    objective that is backpropagated. A loss that adds a regularizer to it (a z-loss) reports
    each weighted term with :func:`forge_lm.losses.aux.report_loss_term`: the core logs the
    value minus those terms as ``loss`` and ``eval/loss`` (the perplexity is ``exp`` of it),
    and each term under its own name.
    """


@hookspec
def forge_lm_register_datasets(register: Any) -> None:
    """Register training datasets.

    Factory: ``factory(options, context: forge_lm.components.DataContext) -> dataset``: an
    iterable of samples (``{"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}``,
    plus ``"document_ids"`` when sequences pack several documents, so that attention stays
    within each one) with ``state_dict()`` and ``load_state_dict(state)``, restoring the exact
    next sample. ``context.split`` is ``"train"`` or ``"eval"``: each dataset defines its own
    held-out split.
    """


@hookspec
def forge_lm_register_metrics_backends(register: Any) -> None:
    """Register metrics backends (console, files, trackers).

    Factory: ``factory(options, context: forge_lm.components.MetricsContext) -> backend``
    with ``start(config, manifest)``, ``log(step, metrics)`` and ``finish(summary)``; see
    :class:`forge_lm.components.MetricsBackend`.
    """


@hookspec
def forge_lm_register_evaluators(register: Any) -> None:
    """Register evaluators: what else runs on the live model at each evaluation, besides the
    held-out loss (downstream benchmarks, generated samples). A run selects them with
    ``[eval] evaluators = ["name"]``, options in ``[eval.<name>]``.

    Factory: ``factory(options, context: forge_lm.components.EvaluatorContext) -> evaluator``
    with ``evaluate(model, step) -> dict[str, float]``; see :class:`forge_lm.components.Evaluator`.
    """


@hookspec
def forge_lm_register_tokenizers(register: Any) -> None:
    """Register tokenizers. Factory: ``factory(options) -> tokenizer`` with ``encode(text)``,
    ``decode(ids)``, ``vocab_size`` and ``eos_id``; see :class:`forge_lm.components.Tokenizer`.
    """


@hookspec
def forge_lm_register_models(register: Any) -> None:
    """Register model families: whole networks. ``[model] name`` selects one (default
    ``"llama"``, the core's own) and the rest of ``[model]`` is its options class, which must
    have ``vocab_size`` (int or None: the tokenizer's), ``max_seq_len`` and ``init_std`` fields.

    Factory: ``factory(options, context: forge_lm.components.ModelContext) -> torch.nn.Module``,
    a :class:`forge_lm.components.LanguageModel`: ``model(input_ids, document_ids=None)`` gives
    logits ``[batch, seq, vocab]``, and ``init_weights(init)`` sets every parameter and buffer
    through the :class:`~forge_lm.components.Initializer`. The factory only constructs: it runs
    on the meta device for a sharded run and the memory estimate, and the core initialises
    afterwards. Components the options select (``[model.ffn]``, ``[model.attention]``) are built
    with ``options.ffn.build(...)``.

    What the rest of Forge needs of a model is declared by the module, each a runtime-checkable
    protocol in :mod:`forge_lm.components`: :class:`~forge_lm.components.ShardedByBlocks`
    (FSDP2 units, activation checkpointing, compile), :class:`~forge_lm.components.TensorParallelModel`
    (``tp``), :class:`~forge_lm.components.PipelineSplittable` (``pp``),
    :class:`~forge_lm.components.ContextParallelModel` (``cp``: ``set_context_parallel``, plugin API 1.3),
    :class:`~forge_lm.components.DecodesWithCache` (``forge generate``),
    :class:`~forge_lm.components.CountsFlops` (MFU), :class:`~forge_lm.components.HasParameterRoles`
    (Muon, weight decay). A layout needing one the model lacks is refused by ``forge config
    validate``, naming the family and the capability. Subclassing
    :class:`forge_lm.model.Transformer` gives all of them. Hugging Face conversion goes through
    :func:`forge_lm_hf_export` and :func:`forge_lm_hf_import`.
    """


@hookspec
def forge_lm_register_attentions(register: Any) -> None:
    """Register attention layers for Forge's transformer blocks; ``[model.attention] name``
    selects one (default ``"gqa"``).

    Factory: ``factory(options, spec: forge_lm.components.AttentionSpec, layer_index) ->
    torch.nn.Module`` whose ``forward(x, cos, sin, mask, is_causal, kv_cache)`` maps ``x``
    ``[batch, seq, dim]`` to the same shape: ``cos``/``sin`` ``[seq, rope_dim]`` are the RoPE
    tables of the tokens' positions (:func:`forge_lm.model.rope.apply_rope`), ``mask`` and
    ``is_causal`` come from :func:`forge_lm.model.attention.attention_mask` (None with
    ``is_causal``, a boolean SDPA mask, a float bias for eager attention, or a FlexAttention
    ``BlockMask``), ``kv_cache`` is None or a :class:`forge_lm.model.KVCache` (the layer stores
    under its ``layer_index``). Capabilities: ``init_weights(init)``, ``tensor_parallel_plan()``
    (as for feed-forward layers), ``rope_dim`` (:class:`~forge_lm.components.RotaryAttention`),
    ``window`` (:class:`~forge_lm.components.WindowedAttention`), and a ``context_parallel``
    attribute (None) for layers that gather keys and values under ``[distributed] cp > 1``
    (:class:`~forge_lm.components.ContextParallelAttention`; Forge's transformer sets it on each
    block's attention from its ``set_context_parallel``).
    """


@hookspec
def forge_lm_register_feed_forwards(register: Any) -> None:
    """Register feed-forward layers for the transformer blocks.

    Factory: ``factory(options, dim, layer_index) -> torch.nn.Module`` mapping
    ``[batch, seq, dim]`` to the same shape. ``[model.ffn]`` chooses the component; its
    factory sees the layer index, so it can build a different layer per index (MoE every
    n-th layer). The module may have these capabilities, each a runtime-checkable protocol in
    :mod:`forge_lm.components` that the core tests with ``isinstance`` (and the conformance
    kit checks where a layer claims one):

    - ``init_weights(init)`` (:class:`~forge_lm.components.InitializesWeights`): called by the
      model instead of its default rule (every ``nn.Linear`` and ``nn.Embedding`` weight drawn
      from ``normal(0, init.std)``, biases 0, norm scales 1). ``init`` is a
      :class:`forge_lm.components.Initializer`: the module sets each of its parameters and
      buffers through it (``init.normal(self.w2.weight,
      init.residual_std)`` for the projection that writes into the residual stream), never
      with ``torch.nn.init`` or torch's global generator. Under ``torchrun`` the layer is built
      on the meta device and may be sharded before it is initialised; ``init`` writes each
      rank's part of the values one process would get. The earlier form
      ``init_weights(std, residual_std)`` is refused with a message.
    - ``active_parameter_count() -> int`` (:class:`~forge_lm.components.CountsActiveParameters`):
      the parameters one token uses (MFU counts these instead of walking the module's
      children), for layers that use only part of their weights per token.
    - ``tensor_parallel_plan() -> {submodule name: ParallelStyle}``
      (:class:`~forge_lm.components.TensorParallelizable`): how ``[distributed] tp > 1`` splits
      the layer; a layer without it is refused under tensor parallelism.
    - ``fsdp_mesh_dims`` (:class:`~forge_lm.components.OwnFSDPUnit`), on a submodule: shard it as
      an FSDP2 unit of its own over these mesh dimensions (forge-moe's experts).

    Auxiliary losses go through :func:`forge_lm.losses.aux.report_aux_loss`.
    """


@hookspec
def forge_lm_register_routers(register: Any) -> None:
    """Register token-to-expert routers for mixture-of-experts layers.

    The MoE layer that uses routers defines their call contract (forge-moe documents it:
    ``factory(options, dim, n_experts, top_k)``, and a router maps ``[batch, seq, dim]`` to
    expert indices, combine weights and weighted auxiliary losses); the core only keeps the
    category so that any plugin can add a router and any config can name one.
    """


@hookspec
def forge_lm_register_model_transforms(register: Any) -> None:
    """Register model transforms (parallelisms, activation checkpointing, compile, freezing, ...).

    Factory: ``factory(options) -> forge_lm.distributed.ModelTransform(slot, enabled, apply)``.
    The training path applies every transform whose ``enabled(context)`` is true, in the
    order of :data:`forge_lm.distributed.TRANSFORM_ORDER` (adaptation, tensor_parallel,
    model_parallel, precision, activation_checkpointing, compile, data_parallel: slots named by
    role; ``expert_parallel`` and ``float8``, their names in plugin API 1.0, are still accepted
    for ``model_parallel`` and ``precision``), by name within a slot, all before the optimizer
    is built; ``apply(model, context)`` changes the model in place, keeps parameter names,
    never changes ``context.config`` and leaves some parameter to train (one that freezes them
    all stops the run naming it, exit 4). Transforms that are not parallelisms (freezing, LoRA,
    pruning) use the ``adaptation`` slot; one that freezes parameters for the first steps only
    calls :func:`forge_lm.model.freezing.freeze_until`. See
    docs/distributed.md.
    """


@hookspec
def forge_lm_register_commands(register: Any) -> None:
    """Add ``forge`` subcommands: ``register(name, command, description="one line for --help")``.

    ``name`` is what users type after ``forge`` (lower-case letters, digits and ``-``); it may
    not be a command of the core (``forge train``...) nor one another loaded plugin registered:
    either makes this plugin broken, the reason naming the clash. ``command`` is an object, or a
    ``"module:attribute"`` string imported only when the command runs or ``forge --help`` lists
    it, with two methods (:class:`forge_lm.components.Command`):

    - ``add_arguments(parser)``: add the command's arguments to its ``argparse`` parser (the
      core adds the plugin switches, ``--block-plugin`` and the rest, itself);
    - ``run(args, plugins) -> int``: do the work; ``args`` is the parsed namespace, ``plugins``
      the loaded :class:`forge_lm.api.PluginManager` (whose registry holds this plugin's
      components); the return value is the exit code.

    A :class:`forge_lm.errors.ForgeError` raised by either is shown as it is (one line, its
    exit code: 2 for a usage or config mistake); anything else, or an object without the two
    methods, is reported as the plugin's bug naming the plugin and its distribution (exit 4).
    A command of a disabled plugin is not offered; ``forge <name>`` then says which plugin
    provides it when that is a first-party one.
    """


# --------------------------------------------------------------------------------------
# Interoperability: conversions a plugin's components need. The first plugin answering wins.
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def forge_lm_hf_export(model: Any, config: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The Hugging Face form of ``model`` (``config`` is its family's options, the ``[model]``
    section without ``name``): ``(config.json as a dict, Hugging Face state dict)``, or None if
    this plugin's family or components are not what the model is made of.

    Raise :class:`forge_lm.errors.ForgeError` to refuse a model made of this plugin's
    components that the Hugging Face format cannot express; its message reaches the user
    unchanged. The core answers last (``trylast``), for a ``llama``-family model (exactly
    :class:`forge_lm.model.Transformer`, not a subclass) with SwiGLU layers and ``gqa``
    attention, as ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with ``qk_norm``). When no plugin
    answers, ``forge export-hf`` stops with a message naming the model's feed-forward (or its
    class) and the plugins it asked."""


@hookspec(firstresult=True)
def forge_lm_hf_import(
    hf_config: dict[str, Any], state: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """For a Hugging Face model this plugin understands (by ``hf_config["model_type"]``):
    ``([model] config table, Forge state dict)``, or None. The table may name its family
    (``name = "deepseek_v3"``); without ``name`` it is the ``llama`` family's.

    Raise :class:`forge_lm.errors.ForgeError` to refuse a model of this type that Forge cannot
    express; ``forge import-hf`` shows its message after the model directory. The core answers
    last (``trylast``), for ``model_type`` ``"llama"`` and ``"qwen3"``. When no plugin answers,
    ``forge import-hf`` stops with a message naming the model type, the plugins it asked and,
    for a type a first-party plugin converts, that plugin."""


# --------------------------------------------------------------------------------------
# Commands: what a plugin adds to a command other than training.
# --------------------------------------------------------------------------------------


@hookspec
def forge_lm_plot_panels(keys: frozenset[str]) -> list[Any] | None:
    """Panels ``forge plot`` draws after the core's, for the metrics this plugin logs.

    ``keys`` holds every metric key the plotted runs logged. Return a list of
    :class:`forge_lm.metrics.plot_panels.PlotPanel` (a title and the keys it draws, each with
    its legend label) for the keys among them this plugin knows, or None. The panels follow
    the core's five in the plugins' call order. Build them without importing matplotlib or
    torch. Anything but a list of ``PlotPanel`` stops ``forge plot``, naming the plugin (exit 4).
    """


# --------------------------------------------------------------------------------------
# Lifecycle: called by the training path, in this order.
# --------------------------------------------------------------------------------------


@hookspec
def forge_lm_configure(config: Any) -> None:
    """Check the fully resolved run config before anything is built.

    Called once, after every config layer is applied. Raise
    :class:`forge_lm.errors.ConfigError` to reject a combination of settings; never mutate
    ``config``.
    """


@hookspec
def forge_lm_train_start(context: Any) -> None:
    """The model, optimizer and data are built; the first step is about to run.

    ``context`` exposes the run (config, model, optimizer, run directory, step).
    """


@hookspec
def forge_lm_step_end(context: Any, step: int, metrics: dict[str, float]) -> dict[str, float] | None:
    """An optimizer step finished. Return extra metrics to log with it, or None.

    ``metrics`` holds the step's metrics on the steps that are logged (``loss``, ``lr``,
    ``grad_norm``, the modules' reports; every ``[metrics] log_interval`` steps, the first and
    the last); on the other steps only ``lr``: reading the loss from the device would make the
    host wait for it at every step. What is returned on a step that is not logged is dropped."""


@hookspec
def forge_lm_step_skipped(context: Any, step: int) -> None:
    """An optimizer step was abandoned: its loss or gradient was not finite, and
    ``[resilience] nan_policy`` (``"skip"`` or ``"rollback"``) goes on without it.

    ``step`` is the number of optimizer steps taken before the abandoned one. The forward and
    backward passes of the bad batch ran, but there is no :func:`forge_lm_step_end` for it:
    anything a component accumulated during them for use at the next step end (a router's
    load counts, a running statistic) must be discarded here, so that the next step sees
    only the batches that are trained on. Called before a rollback restores the checkpoint,
    so a non-persistent buffer is cleared here, not by the restore. Not called when the
    policy stops the run.
    """


@hookspec
def forge_lm_eval_end(context: Any, step: int, metrics: dict[str, float]) -> dict[str, float] | None:
    """An evaluation finished. Return extra metrics to log with it, or None."""


@hookspec
def forge_lm_save_state(context: Any) -> dict[str, Any] | None:
    """Return this plugin's state to store in the checkpoint, or None.

    Plain data and tensors only: checkpoints are loaded without unpickling arbitrary
    objects. Dict keys are strings or integers; containers nest at most 64 levels
    (``forge_lm.plain_data.MAX_DEPTH``) and never hold themselves. The core stores each
    plugin's state under the plugin's name.
    """


@hookspec
def forge_lm_load_state(context: Any, state: dict[str, Any]) -> None:
    """Restore what :func:`forge_lm_save_state` returned when the checkpoint was written.

    On resume it runs before any metrics backend's ``start()`` (a tracker can reopen the same
    remote run) and before :func:`forge_lm_train_start`.
    """


@hookspec
def forge_lm_train_end(context: Any, status: str) -> None:
    """The run ends; ``status`` is ``"completed"``, ``"interrupted"`` or ``"failed"``.

    Called whenever :func:`forge_lm_train_start` was (even if a plugin's ``train_start``
    raised), before the metrics backends' ``finish()``. Raising here is only a warning.
    """
