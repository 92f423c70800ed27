"""The kit's model-family checks: each deliberately broken family fails the check for its defect,
with a message naming the family, what was measured and what was expected.

Every broken family is Forge's own Transformer with one defect, registered by an in-process
plugin; the same family without the defect passes every check (the first test)."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forge_lm import hookimpl
from forge_lm.config import LlamaOptions
from forge_lm.errors import ForgeError
from forge_lm.model import KVCache, Transformer
from forge_lm.model.flops import active_parameter_count
from forge_lm.model.transformer import attention_spec, build_layers
from forge_lm.testing import check_component, component_checks

TINY = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64}


def _family(cls: type[Transformer]):
    """A factory building ``cls`` as the llama family builds Transformer."""

    def factory(options: LlamaOptions, context) -> Transformer:
        ffns = build_layers(options.ffn, context.registry, "feed_forwards", options.dim, options.n_layers)
        spec = attention_spec(options)
        attentions = build_layers(options.attention, context.registry, "attentions", spec, options.n_layers)
        return cls(options, context.vocab_size, ffns, attentions)

    return factory


def _register(manager, name: str, factory, config=LlamaOptions):
    class Families:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_register_models(self, register):
            register(name, factory, config=config, description="broken on purpose")

    info = manager.add_plugin(Families(), "families", distribution="forge-families", version="9.9")
    assert info.status == "ok", info.reason


def _failure(manager, name: str, check: str, options=TINY) -> str:
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks("models", name, manager=manager, options=options)}
    with pytest.raises(AssertionError) as caught:
        checks[check]()
    return str(caught.value)


def test_the_unbroken_family_passes_every_check(manager):
    _register(manager, "sound", _family(Transformer))
    check_component("models", "sound", manager=manager, options=TINY)


class _LooksAhead(Transformer):
    """Forgets the causal mask: every token attends to the whole row."""

    def forward(self, input_ids, document_ids=None, kv_cache=None, positions=None):
        h = self.tok_embeddings(input_ids)
        cos, sin = self.rope(0, input_ids.shape[1])
        for block in self.blocks():
            h = block(h, cos, sin, None, False, None)
        return self.output(self.norm(h))


def test_family_that_sees_later_tokens_fails_the_causality_check(manager):
    _register(manager, "looks_ahead", _family(_LooksAhead))
    message = _failure(manager, "looks_ahead", "no_logit_depends_on_a_later_token")
    assert message.startswith(
        "model family 'looks_ahead' looks ahead: changing the token at position 1 changes the logits at positions "
        "[0] before it by up to "
    )
    assert message.endswith("the kit expects no change there (within 1e-06)")


class _IgnoresDocuments(Transformer):
    def forward(self, input_ids, document_ids=None, kv_cache=None, positions=None):
        return super().forward(input_ids, None, kv_cache, positions)


def test_family_that_attends_across_documents_fails_the_document_check(manager):
    _register(manager, "leaky", _family(_IgnoresDocuments))
    message = _failure(manager, "leaky", "documents_do_not_attend_to_each_other")
    assert message.startswith(
        "model family 'leaky': with document_ids, the second document of a packed row (tokens 5 to 15 of 16) gets "
        "logits up to "
    )
    assert "the kit expects them equal within 1e-05 (a token attends only within its own document)" in message


class _DrawsInItsConstructor(Transformer):
    """A gate drawn with torch.randn in the constructor; init_weights keeps whatever it holds."""

    def __init__(self, config, vocab_size, feed_forwards, attentions=None):
        super().__init__(config, vocab_size, feed_forwards, attentions)
        self.gate = nn.Parameter(1 + 0.1 * torch.randn(config.dim))

    def forward(self, input_ids, document_ids=None, kv_cache=None, positions=None):
        return super().forward(input_ids, document_ids, kv_cache, positions) * self.gate.mean()

    def init_weights(self, init):
        super().init_weights(init)
        init.copy(self.gate, self.gate.detach().clone())


def test_family_drawing_weights_in_its_constructor_fails_the_meta_build_check(manager):
    _register(manager, "randn", _family(_DrawsInItsConstructor))
    message = _failure(manager, "randn", "meta_build_materialises_to_the_plain_build")
    assert message.startswith(
        "model family 'randn': built on the meta device and materialized with seed=1, the model differs from "
        "build_model with that seed at gate (up to "
    )
    assert "values set in the constructor, by torch.nn.init or torch.randn, are lost on the meta device" in message
    # The constructor runs with torch's generator forked, so two plain builds agree: only the meta build tells.
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks("models", "randn", manager=manager, options=TINY)}
    checks["initial_weights_depend_on_the_seed_only"]()


class _InitialisesWithTorch(Transformer):
    def init_weights(self, init):
        super().init_weights(init)
        torch.nn.init.trunc_normal_(self.tok_embeddings.weight, std=init.std)


def test_family_initialising_with_torch_nn_init_fails_the_seed_check(manager):
    _register(manager, "torch_init", _family(_InitialisesWithTorch))
    message = _failure(manager, "torch_init", "initial_weights_depend_on_the_seed_only")
    assert message.startswith(
        "model family 'torch_init': build_model twice with seed=1 gives different weights: "
        "tok_embeddings.weight (up to "
    )
    assert message.endswith("never with torch.nn.init or torch's global generator)")
    assert "at tok_embeddings.weight" in _failure(manager, "torch_init", "meta_build_materialises_to_the_plain_build")


class _LeavesAParameterOut(Transformer):
    def __init__(self, config, vocab_size, feed_forwards, attentions=None):
        super().__init__(config, vocab_size, feed_forwards, attentions)
        self.scale = nn.Parameter(torch.empty(config.dim))
        nn.init.ones_(self.scale)

    def forward(self, input_ids, document_ids=None, kv_cache=None, positions=None):
        return super().forward(input_ids, document_ids, kv_cache, positions) * self.scale.mean()


def test_family_leaving_a_parameter_to_its_constructor_cannot_be_built(manager):
    _register(manager, "uninitialised", _family(_LeavesAParameterOut))
    message = _failure(manager, "uninitialised", "initial_weights_depend_on_the_seed_only")
    assert message.startswith("model family 'uninitialised' cannot be built by forge_lm.model.build_model: ")
    assert "no initialisation rule set scale" in message


class _DropoutAlwaysOn(Transformer):
    def forward(self, input_ids, document_ids=None, kv_cache=None, positions=None):
        h = super().forward(input_ids, document_ids, kv_cache, positions)
        return F.dropout(h, p=0.1)  # training=True whatever the mode: should be training=self.training


def test_family_with_dropout_left_on_in_eval_fails_the_determinism_check(manager):
    _register(manager, "dropout", _family(_DropoutAlwaysOn))
    message = _failure(manager, "dropout", "forward_is_deterministic_in_eval_mode")
    assert message.startswith("model family 'dropout': in eval mode two forwards of the same tokens give logits up to ")
    assert message.endswith("the kit expects identical logits (dropout or other randomness left on outside training?)")


class _UnusedParameter(Transformer):
    def __init__(self, config, vocab_size, feed_forwards, attentions=None):
        super().__init__(config, vocab_size, feed_forwards, attentions)
        self.unused = nn.Parameter(torch.empty(config.dim))

    def init_weights(self, init):
        super().init_weights(init)
        init.zeros(self.unused)


def test_family_with_a_parameter_outside_the_graph_fails_the_gradient_check(manager):
    _register(manager, "unused", _family(_UnusedParameter))
    message = _failure(manager, "unused", "every_trainable_parameter_gets_a_gradient")
    assert message.startswith(
        "model family 'unused': 1 of 21 trainable parameters receive no gradient from a loss on the logits and the "
        "auxiliary losses: "
        "['unused']; the kit expects every trainable parameter to get one"
    )


class _NoAttentionTerm(Transformer):
    def flops_per_token(self, seq_len):
        return 6.0 * active_parameter_count(self)


class _AttentionTwice(Transformer):
    def flops_per_token(self, seq_len):
        return super().flops_per_token(seq_len) + 12.0 * self.config.n_layers * self.config.dim * seq_len


class _CausalHalf(Transformer):
    def flops_per_token(self, seq_len):
        return super().flops_per_token(seq_len) - 6.0 * self.config.n_layers * self.config.dim * seq_len


@pytest.mark.parametrize(
    ("cls", "declared"),
    [(_NoAttentionTerm, "196992"), (_AttentionTwice, "295296"), (_CausalHalf, "221568")],
    ids=["no_attention_term", "attention_counted_twice", "causal_half"],
)
def test_family_declaring_the_wrong_flops_fails_the_flops_check(manager, cls, declared):
    _register(manager, "miscounted", _family(cls))
    message = _failure(manager, "miscounted", "flops_per_token_matches_the_counted_matmuls")
    assert message.startswith(
        f"model family 'miscounted': flops_per_token(64) declares {declared} FLOPs per token, but a forward and "
        "backward of one sequence of 64 tokens counts 245184 per token in matrix products (attention's included); "
        "the kit expects between 242732 and 248605 (the count, plus 6 per vector parameter, within 1%"
    )


class _ForgetfulCache(KVCache):
    """Decoding forgets the first cached token."""

    def update(self, layer, keys, values):
        k, v = super().update(layer, keys, values)
        return (k[:, :, 1:], v[:, :, 1:]) if keys.shape[2] == 1 else (k, v)


class _ForgetfulDecoder(Transformer):
    def new_kv_cache(self, max_len=None):
        return _ForgetfulCache(max_len if max_len is not None else self.config.max_seq_len)


def test_family_whose_cache_drops_a_token_fails_the_decoding_check(manager):
    _register(manager, "forgetful", _family(_ForgetfulDecoder))
    message = _failure(manager, "forgetful", "cached_decoding_matches_the_full_forward")
    assert message.startswith(
        "model family 'forgetful': with a KV cache (prefill of 8 tokens, then one token at a time) the logits at "
        "positions [8, 9, 10, 11, 12, 13, 14, 15] differ from the full forward's by up to "
    )


class _LmHead(Transformer):
    """An untied head whose roles the model declares, getting the head wrong."""

    def parameter_roles(self):
        return {
            name: "embedding" if name == "tok_embeddings.weight" else "matrix" for name, _ in self.named_parameters()
        }


def test_family_declaring_its_head_a_matrix_fails_the_roles_check(manager):
    _register(manager, "headless", _family(_LmHead))
    message = _failure(manager, "headless", "parameter_roles_cover_every_parameter", {**TINY, "tie_embeddings": False})
    assert message.startswith(
        "model family 'headless': the weights ['output.weight'] of shape [vocab, ...] (the output head) have roles "
        "['matrix']; the kit expects 'output', or 'embedding' for a head tied to the embedding"
    )


@attrs.define
class _BigramOptions:
    vocab_size: int | None = None
    max_seq_len: int = 32
    init_std: float = 0.02


class _Bigram(nn.Module):
    """The smallest family: each token's logits from itself alone. No cache, no FLOP count."""

    def __init__(self, options, vocab_size):
        super().__init__()
        self.config = options
        self.tok_embeddings = nn.Embedding(vocab_size, 16)
        self.output = nn.Linear(16, vocab_size, bias=False)

    def forward(self, input_ids, document_ids=None):
        return self.output(self.tok_embeddings(input_ids))

    def init_weights(self, init):
        init.normal(self.tok_embeddings.weight, init.std)
        init.normal(self.output.weight, init.std)


def test_family_without_capabilities_passes_with_those_checks_skipped(manager):
    _register(manager, "bigram", lambda options, context: _Bigram(options, context.vocab_size), _BigramOptions)
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks("models", "bigram", manager=manager)}
    with pytest.raises(pytest.skip.Exception, match="has no new_kv_cache"):
        checks["cached_decoding_matches_the_full_forward"]()
    with pytest.raises(pytest.skip.Exception, match="has no flops_per_token"):
        checks["flops_per_token_matches_the_counted_matmuls"]()
    with pytest.raises(pytest.skip.Exception, match=r"declares no set_context_parallel\(context_parallel\)"):
        checks["set_context_parallel_reaches_every_layer_declaring_it"]()
    check_component("models", "bigram", manager=manager)


def _passes(manager, name: str, check: str, options=TINY) -> None:
    """Run one check, failing (not skipping) the test when the check does not apply."""
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks("models", name, manager=manager, options=options)}
    try:
        checks[check]()
    except pytest.skip.Exception as skipped:
        pytest.fail(f"{check} was skipped for '{name}': {skipped}")


CONTEXT_PARALLEL = "set_context_parallel_reaches_every_layer_declaring_it"


def test_the_llama_family_hands_the_context_parallel_group_to_every_layer(manager):
    _passes(manager, "llama", CONTEXT_PARALLEL)
    _passes(manager, "llama", CONTEXT_PARALLEL, {**TINY, "attention": {"name": "sliding_window", "window": 4}})


class _Mixer(nn.Module):
    """A parameter-free layer that would gather across the context-parallel group."""

    context_parallel = None

    def forward(self, x):
        return x


class _MissesItsMixer(Transformer):
    """A layer outside the blocks that declares context_parallel; the inherited
    set_context_parallel reaches only the blocks' attention."""

    def __init__(self, config, vocab_size, feed_forwards, attentions=None):
        super().__init__(config, vocab_size, feed_forwards, attentions)
        self.mixer = _Mixer()


class _ReachesItsMixer(_MissesItsMixer):
    def set_context_parallel(self, context_parallel):
        super().set_context_parallel(context_parallel)
        self.mixer.context_parallel = context_parallel


def test_family_whose_set_context_parallel_misses_a_layer_fails_the_context_parallel_check(manager):
    _register(manager, "misses_mixer", _family(_MissesItsMixer))
    message = _failure(manager, "misses_mixer", CONTEXT_PARALLEL)
    assert message.startswith(
        "model family 'misses_mixer': set_context_parallel(context_parallel) does not reach mixer (1 of the 4 modules "
        "declaring a context_parallel attribute); the kit expects each to hold the object passed"
    )
    assert message.endswith(
        "override set_context_parallel, call super().set_context_parallel(context_parallel) and set "
        "context_parallel on those layers too"
    )


def test_the_same_family_reaching_its_layer_from_an_override_passes(manager):
    _register(manager, "reaches_mixer", _family(_ReachesItsMixer))  # the fix the failure gives
    _passes(manager, "reaches_mixer", CONTEXT_PARALLEL)


class _KeepsTheGroup(Transformer):
    """Ignores set_context_parallel(None): the layers keep gathering."""

    def set_context_parallel(self, context_parallel):
        if context_parallel is not None:
            super().set_context_parallel(context_parallel)


def test_family_that_keeps_the_group_after_none_fails_the_context_parallel_check(manager):
    _register(manager, "keeps_group", _family(_KeepsTheGroup))
    message = _failure(manager, "keeps_group", CONTEXT_PARALLEL)
    assert message.startswith(
        "model family 'keeps_group': set_context_parallel(None) leaves context_parallel set on (the model itself), "
        "layers.0.attention, layers.1.attention; the kit expects None on every module declaring it again"
    )


class _RefusesTheGroup(Transformer):
    def set_context_parallel(self, context_parallel):
        if context_parallel is not None:
            raise ForgeError("context parallelism: the layer Mixer does not gather keys and values.")
        super().set_context_parallel(context_parallel)


def test_family_refusing_the_group_skips_the_context_parallel_check(manager):
    _register(manager, "refuses_group", _family(_RefusesTheGroup))
    checks = {
        c.id.rsplit(":", 1)[1]: c for c in component_checks("models", "refuses_group", manager=manager, options=TINY)
    }
    with pytest.raises(pytest.skip.Exception, match=r"refuses context parallelism with these options: .* layer Mixer"):
        checks[CONTEXT_PARALLEL]()
