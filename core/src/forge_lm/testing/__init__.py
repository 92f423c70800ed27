"""Conformance kit: checks that a component or a plugin distribution honours Forge's contracts.

In the spirit of scikit-learn's ``parametrize_with_checks``; plugin authors run it in their
own tests::

    from forge_lm.testing import parametrize_with_checks

    @parametrize_with_checks(
        components=[("losses", "my_loss", {"reference": my_reference_loss})],
        distributions=["my-forge-plugin"],
    )
    def test_conformance(check):
        check()

Per category, what is checked. Every failure message names the component, what the kit
expected (the pass mark) and what it measured.

- optimizers: every trainable parameter is in exactly one group; the loss of a tiny problem
  falls by at least 20% within 40 steps (run at ``lr = 1e-2`` unless the options give one); a
  state-dict round trip (plain data, ``weights_only`` loadable) resumes bit for bit; where
  declared, no parameter keeps more state tensors of its size than ``FORGE_LM_OPTIMIZER_STATES``
  on the options class says (``DeclaresOptimizerStates``), and ``evolving_group_keys`` is a tuple
  of keys every parameter group holds (``EvolvingGroupKeys``).
- schedulers: the documented linear warmup ``(s + 1) / W``, always run with a warmup: the
  warmup field is ``warmup_steps`` (:class:`~forge_lm.components.WarmupOptions`'s) or else the
  options' one integer field whose name holds ``warmup`` (``warmup``, ``warmup_iters``), set to
  the options table's value when it gives one, else ``W = 4`` (the check is skipped, with the
  reason, when the options have no such field); rates within ``[0, base]`` with a first step
  above 0; a state-dict round trip at step 37 resumes the same schedule.
- losses: finite value and gradients; positions labelled ``IGNORE_INDEX`` have no effect; the
  value is a token mean (what gradient accumulation relies on); equality with an independent
  reference.
- datasets: sample form; reproducibility; a state round trip restores the exact next sample,
  through ``state_dict()`` and, for a ``SavesLocalState`` dataset, ``local_state_dict()``;
  data-parallel ranks get distinct samples; a ``ReadsBatches`` dataset's ``read_batch(size)``
  is ``size`` samples of its iterator stacked (keys, values, dtypes) and advances its state as
  they do.
- metrics backends: writes only inside the run directory; what was logged is recorded.
- tokenizers: ids and ``eos_id`` within the vocabulary; ``decode(encode(text)) == text`` over
  plain text, tabs and newlines, control characters, a character of each of Unicode's 17 planes
  and the empty string; ``encode`` adds no ``eos_id`` (``encode("") == []``); ``decode`` gives no
  text for ``eos_id`` (two documents with it between decode as the two texts).
- feed-forward layers: shape-preserving, finite, gradients reach the input and every parameter;
  in eval mode two passes are identical; initialisation only through the Initializer (two
  builds with one seed agree bitwise, another seed differs, a build on the meta device
  initialises to the plain build's values).
- model transforms, on a one-process CPU run of a tiny llama model (the transform's options in
  ``[transforms.<name>]``): the factory returns a ``ModelTransform`` whose slot is one of
  ``TRANSFORM_ORDER``; ``enabled(context)`` answers a bool; neither ``enabled`` nor ``apply``
  changes the run's config; ``apply`` keeps every parameter name and leaves at least one
  parameter to train (skipped, with the reason, when the transform is not enabled in that run).
- evaluators, built with a one-process CPU ``EvaluatorContext`` (the ``bytes`` tokenizer;
  evaluation data as a run gives it, ``validation`` and ``eval_sets["kit"]``, two batches each of
  random token windows) and called as the loop calls them (a tiny llama model in eval mode, under ``torch.no_grad()``):
  ``evaluate`` returns a mapping of metric names to finite Python numbers (an undefined metric
  is left out); the weights (values and dtypes), ``requires_grad``, gradients and every
  module's train/eval mode are the same after the call; a ``ReportsResults`` evaluator's
  ``results``, after a call that returned metrics (up to 3 calls), are a mapping JSON can hold
  and its ``table`` a string.
- routers (the contract forge-moe defines: ``factory(options, dim, n_experts, top_k)``,
  ``router(x) -> indices, weights, aux_losses``): shapes and dtypes (``[batch * seq, top_k]``,
  int64 and float32; scalar aux losses); ``top_k`` distinct experts in ``[0, n_experts)`` per
  token; weights finite, non-negative and, for a normalising router, summing to 1 per token;
  a loss on the weights reaches the router's parameters, and every trainable parameter gets a
  finite gradient from the weights and aux losses; the same input is routed the same way (eval
  mode).
- model families, built by ``forge_lm.model.build_model`` from the options table (the family's
  defaults when none is given; pass ``options`` to shrink it) on a 61-token vocabulary, on the
  CPU in fp32: logits ``[batch, seq, vocab]``, finite; changing the token at position ``t``
  changes no logit before ``t`` and some at or after it; in eval mode two forwards are
  identical; with ``document_ids`` (when ``forward`` takes them) each packed document gets the
  logits it gets alone; ``seed`` alone decides the weights, and a model built on the meta device
  and materialized equals the plain build bitwise (values set in the constructor do not
  survive); a loss on the logits plus the reported auxiliary losses reaches every trainable
  parameter; where declared, cached decoding (prefill, then token by token) matches the full
  forward within 1e-5, and ``flops_per_token`` is within 1% of the products torch counts in a
  forward and backward (attention's included, not halved for causality; plus 6 per vector
  parameter); ``parameter_roles`` covers every parameter, embeddings ``"embedding"``, the head
  ``"output"`` (or tied); a ``GenerationLimits`` model's ``vocab_size`` is its logits' width and
  its ``max_seq_len`` its options'; a ``ContextParallelModel``'s ``set_context_parallel(cp)``
  sets ``cp`` on the model and on every module declaring ``context_parallel``, and
  ``set_context_parallel(None)`` sets None on them again (skipped when it refuses the group
  with a ``ForgeError``).
- attention layers, built with a small ``AttentionSpec`` and fed RoPE tables and the masks of
  ``attention_mask`` in SDPA's and eager attention's forms: shape-preserving and finite; no
  output depends on a later position, each on its own; a ``WindowedAttention`` query sees
  exactly its ``window`` most recent keys (and the layer's window is its options'); eval
  determinism; initialisation through the Initializer (seed-determined, the same from the meta
  device); gradients to the input and every parameter; decoding with a ``KVCache`` matches the
  full pass; the capabilities it claims are well formed.
- every category: the options survive a round trip through a config table; an option the
  kit's table gets wrong is named as users write the section (``[model.ffn] hidden``).
- distributions: entry points in the ``forge_lm`` group; each loads (its module is installed
  and imports, the object it names exists; a failure names the entry point, what is missing and
  the change to the package, and every later check that needs the module says the same); plugin
  modules import no heavy dependency; the declared plugin API range admits this core; the plugin
  loads with status ok.
- a component the kit cannot find (its plugin did not load, or nothing registers it) is one
  failing check, ``<category>:<name>:is_registered``, with the author's fix (an installed
  plugin's packaging problem, as above), not an error while pytest collects the tests.

Keywords of :func:`component_checks` (the third item of a ``parametrize_with_checks``
component tuple holds them; an aid a category does not use is refused with a ``TypeError``):

- every category: ``options``, the component's config table (as in its TOML section; checks
  override some keys, such as ``lr`` for optimizers and ``warmup_steps`` for schedulers, only
  when the table leaves them out); ``manager``, the ``PluginManager`` to resolve it in (default:
  a fresh one that loads every installed plugin).
- losses: ``reference=callable(logits, labels) -> scalar``, an independent implementation the
  loss must match (required for a third-party loss; the core's losses have their own).
- datasets: ``context=DataContext(...)``, the context datasets are built with (default:
  ``seq_len=16, vocab_size=64, seed=7``); the kit changes only ``dp_rank``/``dp_size`` in it.
  Give it a tokenizer, a registry or sizes your dataset needs.
- metrics backends: ``read_back=callable(run_dir, output) -> [(step, metrics), ...]``, reading
  back what the backend recorded (``output`` is what it printed to standard output); required
  for a third-party backend.
- tokenizers: ``lossless=False`` turns the ``decode(encode(text)) == text`` check off for a
  tokenizer whose normalisation changes text (the vocabulary check still runs).
- routers: ``n_experts`` (default 8) and ``top_k`` (default 2), the sizes the router is built
  with; ``normalized``: whether a token's weights must sum to 1 (default: true unless the
  options have ``renormalize = False``).
- attentions: ``spec=AttentionSpec(...)``, the sizes the layer is built with (default ``dim=32,
  n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2, max_seq_len=64``); the kit changes only its
  ``backend``.
- model transforms: ``config``, a run config table merged over the kit's (``{"train":
  {"activation_checkpointing": "full"}}``), for a transform enabled by other sections.
- evaluators: ``context=EvaluatorContext(...)``, the context the evaluator is built with, for
  one that needs another tokenizer or sizes.

The kit's own regression suite is ``tests/kit_mutants`` in Forge's repository: broken
components of every category, each failed on the check it names.
"""

from forge_lm.testing._kit import Check, check_component, component_checks, parametrize_with_checks
from forge_lm.testing._packaging import distribution_checks
from forge_lm.testing._tiny import TINY_MODEL

__all__ = [
    "TINY_MODEL",
    "Check",
    "check_component",
    "component_checks",
    "distribution_checks",
    "parametrize_with_checks",
]
