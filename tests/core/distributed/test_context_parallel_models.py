"""How context parallelism reaches a model's attention layers, in one process: the core asks the
model (``ContextParallelModel.set_context_parallel``, plugin API 1.3) and never walks its modules;
a model of plugin API 1.2's protocol (the ``context_parallel`` attribute alone) still runs, walked,
with a deprecation warning naming its family; a model or layer without the capability is refused,
naming it. The ranks themselves are test_context_parallel.py's (torchrun, slow)."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from forge_lm.components import ContextParallelAttention, ContextParallelModel
from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims
from forge_lm.distributed.context_parallel import (
    ContextParallel,
    declares_only_the_attribute,
    enable_context_parallel,
)
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.model import build_model
from forge_lm.model.attention import Attention
from forge_lm.model.capabilities import check_family_supports, deprecated_capabilities, missing_capabilities
from forge_lm.testing import TINY_MODEL

VOCAB = 97
CP2 = ParallelDims(cp=2)
GROUP = ContextParallel(group=None, rank=0, size=2)  # no collective runs here: only who holds it


@attrs.frozen
class TinyOptions:
    dim: int = 8
    vocab_size: int | None = None
    max_seq_len: int = 64
    init_std: float = 0.02


class Attends(nn.Module):
    """A layer that declares ``context_parallel`` (ContextParallelAttention)."""

    context_parallel = None

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Family(nn.Module):
    def __init__(self, options: TinyOptions, vocab_size: int) -> None:
        super().__init__()
        self.config = options
        self.embed = nn.Embedding(vocab_size, options.dim)
        self.head = nn.Linear(options.dim, vocab_size, bias=False)

    def init_weights(self, init) -> None:
        init.normal(self.embed.weight, init.std)
        init.normal(self.head.weight, init.std)
        for module in self.modules():
            if isinstance(module, Attends):
                init.normal(module.proj.weight, init.std)


class TellsItsLayers(_Family):
    """Plugin API 1.3's way: it keeps its attention layers in a plain list (no submodules, so no
    walk of its modules reaches them) and hands them the group itself. ``decoy`` is a submodule
    that declares the attribute but is not one of the layers the model tells."""

    context_parallel = None

    def __init__(self, options: TinyOptions, vocab_size: int) -> None:
        super().__init__(options, vocab_size)
        self.hidden = [Attends(options.dim), Attends(options.dim)]  # a list: not registered as modules
        self.decoy = Attends(options.dim)

    def forward(self, input_ids, document_ids=None, kv_cache=None, positions=None):
        h = self.embed(input_ids)
        for layer in self.hidden:
            h = h + layer(h)
        return self.head(h)

    def set_context_parallel(self, context_parallel) -> None:
        self.context_parallel = context_parallel
        for layer in self.hidden:
            layer.context_parallel = context_parallel


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = Attends(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(x)


class AttributeOnly(_Family):
    """Plugin API 1.2's ContextParallelModel: the attribute, blocks whose attention declares it,
    and no set_context_parallel."""

    context_parallel = None

    def __init__(self, options: TinyOptions, vocab_size: int) -> None:
        super().__init__(options, vocab_size)
        self.layers = nn.ModuleList([_Block(options.dim), _Block(options.dim)])

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, input_ids, document_ids=None, kv_cache=None, positions=None):
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h)
        return self.head(h)


class NoGather(nn.Module):
    """The core's attention wrapped in a layer that declares no ``context_parallel`` itself (the
    module it wraps does: a walk of the modules would have set that one)."""

    def __init__(self, spec, layer_index: int) -> None:
        super().__init__()
        self.inner = Attention(spec.dim, spec.n_heads, spec.n_kv_heads, layer_index)

    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        return self.inner(x, cos, sin, mask, is_causal, kv_cache)


class Families:
    FORGE_LM_PLUGIN_API = ">=1.2,<2"

    def forge_lm_register_models(self, register):
        for name, family in (("tells", TellsItsLayers), ("attribute_only", AttributeOnly)):
            register(
                name,
                lambda options, context, f=family: f(options, context.vocab_size),
                config=TinyOptions,
                description=f"a {name} model",
            )

    def forge_lm_register_attentions(self, register):
        register("nogather", lambda options, spec, i: NoGather(spec, i), description="gqa inside a wrapper")


@pytest.fixture
def families(manager):
    info = manager.add_plugin(Families(), "families", distribution="forge-families", version="0.3")
    assert info.status == "ok", info.reason
    return manager


def _config(manager, *overrides: str):
    return load_config(None, ["--train.seq_len=16", *overrides], manager.registry)


def _built(manager, *overrides: str) -> tuple[nn.Module, object]:
    config = _config(manager, *overrides)
    return build_model(config.model, VOCAB, manager.registry, seed=0), config


def test_the_transformer_hands_the_group_to_each_blocks_attention_and_takes_it_back(manager):
    model, _ = _built(manager, *TINY_MODEL)
    model.decoy = Attends(8)  # declares the attribute, but no block holds it: the core leaves it alone
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
    assert isinstance(model, ContextParallelModel)
    assert not declares_only_the_attribute(model)

    enable_context_parallel(model, GROUP)

    assert model.context_parallel is GROUP
    assert [block.attention.context_parallel for block in model.blocks()] == [GROUP, GROUP]
    assert model.decoy.context_parallel is None
    model.set_context_parallel(None)
    assert model.context_parallel is None
    assert all(block.attention.context_parallel is None for block in model.blocks())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before)


def test_a_model_tells_layers_no_walk_of_its_modules_reaches(families, capsys):
    model, config = _built(families, "--model.name=tells")
    assert isinstance(model, ContextParallelModel)
    assert not any(layer is module for layer in model.hidden for module in model.modules())
    assert missing_capabilities(model, config, CP2) == []
    assert deprecated_capabilities(model, CP2) == []
    check_family_supports(config, VOCAB, families.registry, CP2)
    assert capsys.readouterr().err == ""  # no deprecation warning

    enable_context_parallel(model, GROUP)

    assert model.context_parallel is GROUP
    assert [layer.context_parallel for layer in model.hidden] == [GROUP, GROUP]
    assert model.decoy.context_parallel is None  # the core asked the model and walked nothing


def test_a_model_of_plugin_api_1_2_still_runs_walked_with_a_deprecation_warning_naming_its_family(families, capsys):
    model, config = _built(families, "--model.name=attribute_only")
    assert declares_only_the_attribute(model)
    assert not isinstance(model, ContextParallelModel)
    assert missing_capabilities(model, config, CP2) == []

    check_family_supports(config, VOCAB, families.registry, CP2)

    err = capsys.readouterr().err
    assert err.startswith(
        "forge: warning: model family 'attribute_only' from plugin 'families' (forge-families 0.3): "
        "[distributed] cp = 2: the model declares context parallelism as plugin API 1.2 did"
    )
    assert "deprecated since plugin API 1.3" in err
    assert "plugin API 2 will no longer do" in err
    assert "should define set_context_parallel" in err
    check_family_supports(config, VOCAB, families.registry, ParallelDims())
    assert capsys.readouterr().err == ""  # cp = 1 uses nothing deprecated

    enable_context_parallel(model, GROUP)

    assert model.context_parallel is GROUP
    assert [block.attention.context_parallel for block in model.blocks()] == [GROUP, GROUP]


def test_a_model_without_the_capability_is_refused_naming_set_context_parallel(families):
    class Plain(nn.Module):  # a model with positions in forward and nothing else
        def forward(self, input_ids, document_ids=None, kv_cache=None, positions=None):
            return input_ids

    config = _config(families, "--model.name=tells")
    (problem,) = missing_capabilities(Plain(), config, CP2)
    assert problem == (
        "[distributed] cp = 2 needs a model whose forward takes positions and that hands the context-parallel "
        "group to its attention layers (ContextParallelModel: set_context_parallel(context_parallel) and a "
        "context_parallel attribute); set cp = 1"
    )
    with pytest.raises(TypeError, match=r"Plain declares no set_context_parallel\(context_parallel\)"):
        enable_context_parallel(Plain(), GROUP)


def test_an_attention_layer_that_declares_no_context_parallel_is_refused_naming_it(families):
    overrides = (*TINY_MODEL, "--model.attention.name=nogather")
    model, config = _built(families, *overrides)
    assert not isinstance(model.layers[0].attention, ContextParallelAttention)
    with pytest.raises(ConfigError) as caught:
        check_family_supports(config, VOCAB, families.registry, CP2)
    message = str(caught.value)
    assert message.startswith("model family 'llama' from plugin 'core.models'")
    assert message.endswith(
        "cannot run this layout: [distributed] cp = 2: the blocks' attention layer NoGather does not gather keys "
        "and values across ranks (it declares no context_parallel attribute, ContextParallelAttention); set cp = 1 "
        "or choose a layer that supports it."
    )
    # The model refuses it too, and sets nothing (not even the wrapped layer a walk would have found).
    with pytest.raises(ForgeError, match="attention layer NoGather does not gather keys and values"):
        enable_context_parallel(model, GROUP)
    assert model.context_parallel is None
    assert all(block.attention.inner.context_parallel is None for block in model.blocks())
