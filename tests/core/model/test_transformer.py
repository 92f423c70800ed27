"""The dense transformer against a float64 reference written out here, head by head and token by token."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from torch import nn

from forge_lm.config import ComponentConfig, ModelSection
from forge_lm.errors import ForgeError, PluginError
from forge_lm.model import build_model
from forge_lm.model.attention import attention_mask
from forge_lm.plugins import PluginStatus

from .conftest import VOCAB, perturb_norms


def reference_logits(model: nn.Module, ids: list[int], documents: list[int] | None = None) -> torch.Tensor:
    """Logits ``[T, vocab]`` of one sequence, in float64, from the model's weights and its config alone.

    Written independently of the model's code: explicit loops over heads and positions, RoPE as
    a rotation of the pairs ``(v[i], v[i + D/2])`` by ``pos * theta^(-2i/D)``, key/value head
    ``h // (n_heads / n_kv_heads)`` for query head ``h``, and each token attending to the earlier
    tokens of its own document.
    """
    cfg = model.config
    p = {name: t.detach().double() for name, t in model.state_dict().items()}
    heads, kv_heads, d_head = cfg.n_heads, cfg.kv_heads, cfg.head_size
    T = len(ids)

    def norm(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "rmsnorm":
            return x / torch.sqrt((x**2).mean(-1, keepdim=True) + cfg.norm_eps) * weight
        centred = x - x.mean(-1, keepdim=True)
        return centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    def rope(v: torch.Tensor, pos: int) -> torch.Tensor:
        out = v.clone()
        half = d_head // 2
        for i in range(half):
            angle = pos * cfg.rope_theta ** (-2 * i / d_head)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = v[i] * c - v[i + half] * s
            out[i + half] = v[i + half] * c + v[i] * s
        return out

    x = p["tok_embeddings.weight"][ids]  # [T, dim]
    for layer in range(cfg.n_layers):
        w = {name[len(f"layers.{layer}.") :]: t for name, t in p.items() if name.startswith(f"layers.{layer}.")}
        h = norm(x, w["attention_norm.weight"], cfg.norm)
        q = (h @ w["attention.wq.weight"].T).view(T, heads, d_head)
        k = (h @ w["attention.wk.weight"].T).view(T, kv_heads, d_head)
        v = (h @ w["attention.wv.weight"].T).view(T, kv_heads, d_head)
        if cfg.qk_norm:
            q = norm(q, w["attention.q_norm.weight"], "rmsnorm")
            k = norm(k, w["attention.k_norm.weight"], "rmsnorm")
        q = torch.stack([torch.stack([rope(q[t, hd], t) for hd in range(heads)]) for t in range(T)])
        k = torch.stack([torch.stack([rope(k[t, g], t) for g in range(kv_heads)]) for t in range(T)])
        out = torch.zeros(T, heads, d_head, dtype=torch.float64)
        for hd in range(heads):
            g = hd // (heads // kv_heads)
            for t in range(T):
                seen = [s for s in range(t + 1) if documents is None or documents[s] == documents[t]]
                scores = torch.stack([q[t, hd] @ k[s, g] for s in seen]) / math.sqrt(d_head)
                weights = torch.softmax(scores, dim=0)
                out[t, hd] = sum(wt * v[s, g] for wt, s in zip(weights, seen, strict=True))
        x = x + out.reshape(T, heads * d_head) @ w["attention.wo.weight"].T
        h = norm(x, w["ffn_norm.weight"], cfg.norm)
        gate = h @ w["feed_forward.w1.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (h @ w["feed_forward.w3.weight"].T)) @ w["feed_forward.w2.weight"].T
    return norm(x, p["norm.weight"], cfg.norm) @ p["output.weight"].T


ARCHITECTURES = {
    "mha-1-layer": {"n_layers": 1},
    "gqa-2-kv-heads": {"n_kv_heads": 2},
    "mqa-1-kv-head": {"n_kv_heads": 1},
    "qk-norm": {"qk_norm": True, "n_kv_heads": 2},
    "layernorm-untied": {"norm": "layernorm", "tie_embeddings": False},
    "rope-theta-100": {"rope_theta": 100.0},
}


@pytest.mark.parametrize("fields", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
def test_logits_equal_the_written_out_reference(make_model, fields):
    model = make_model(**fields)
    perturb_norms(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    assert logits.dtype == torch.float32
    for row in range(2):
        expected = reference_logits(model, ids[row].tolist())
        assert torch.allclose(logits[row].double(), expected, atol=2e-5, rtol=0), fields
    assert logits.std() > 0.1  # large enough that the tolerance above is meaningful


def test_document_mask_matches_the_reference(make_model):
    model = make_model(n_kv_heads=2)
    documents = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    logits = model(ids, torch.tensor([documents]))
    assert torch.allclose(logits[0].double(), reference_logits(model, ids[0].tolist(), documents), atol=2e-5, rtol=0)


def test_packed_documents_get_the_logits_each_document_gets_alone(make_model):
    model = make_model(n_kv_heads=2)
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randint(0, VOCAB, (1, 7), generator=gen), torch.randint(0, VOCAB, (1, 5), generator=gen)
    packed = torch.cat([first, second], dim=1)
    # Row 0 packs the two documents; row 1 is one 12-token document (no mask effect at all).
    ids = torch.cat([packed, packed])
    documents = torch.tensor([[0] * 7 + [1] * 5, [4] * 12])
    logits = model(ids, documents)
    assert torch.allclose(logits[0, :7], model(first)[0], atol=1e-5, rtol=0)
    assert torch.allclose(logits[0, 7:], model(second)[0], atol=1e-5, rtol=0)
    assert torch.allclose(logits[1], model(packed)[0], atol=1e-5, rtol=0)
    assert not torch.allclose(logits[0, 7:], logits[1, 7:], atol=1e-3)  # the mask did cut attention


def test_rows_of_one_document_each_take_the_fused_causal_path(make_model):
    """One document per row (any ids, row by row) is plain causal attention: no mask tensor, the
    same logits as without document ids and as the reference."""
    single = torch.tensor([[3] * 9, [8] * 9])
    assert attention_mask(single, 0, 9, torch.device("cpu")) == (None, True)
    mask, is_causal = attention_mask(torch.tensor([[3] * 9, [8] * 8 + [9]]), 0, 9, torch.device("cpu"))
    assert mask.shape == (2, 1, 9, 9)  # one row packs two documents: the mask for the whole batch
    assert not is_causal
    model = make_model(n_kv_heads=2)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    logits = model(ids, single)
    assert torch.equal(logits, model(ids))
    assert torch.allclose(logits[1].double(), reference_logits(model, ids[1].tolist(), [8] * 9), atol=2e-5, rtol=0)


def test_sequences_longer_than_max_seq_len_are_refused_with_the_fix(make_model):
    model = make_model(max_seq_len=8)
    model(torch.zeros(1, 8, dtype=torch.long))  # exactly max_seq_len is fine
    with pytest.raises(
        ForgeError, match=r"9 tokens exceeds the model's max_seq_len \(8\).*raise \[model\] max_seq_len"
    ):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_mismatched_document_ids_are_refused(make_model):
    model = make_model()
    with pytest.raises(ForgeError, match="must have the shape of input_ids"):
        model(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


def test_same_seed_builds_the_same_weights_and_another_seed_does_not(make_model):
    a, b, c = make_model(seed=7), make_model(seed=7), make_model(seed=8)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.layers[0].attention.wq.weight, c.layers[0].attention.wq.weight)


def test_init_gives_residual_projections_init_std_over_sqrt_2_layers(manager):
    config = ModelSection(dim=256, n_layers=8, n_heads=4, init_std=0.02, tie_embeddings=False, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(config, 512, manager.registry)
    residual = 0.02 / math.sqrt(2 * 8)  # 0.005
    expected = {"tok_embeddings.weight": 0.02, "output.weight": 0.02}
    for i in (0, 7):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            expected[f"layers.{i}.{name}.weight"] = 0.02
        expected[f"layers.{i}.attention.wo.weight"] = residual
        expected[f"layers.{i}.feed_forward.w2.weight"] = residual
    params = dict(model.named_parameters())
    for name, std in expected.items():
        # >= 32768 samples each: the sample std is within 1% of the true one with overwhelming odds
        assert abs(params[name].std().item() - std) < 0.03 * std, name
        assert abs(params[name].mean().item()) < 0.03 * std, name
    for name, param in params.items():
        if param.ndim == 1:
            assert torch.equal(param, torch.ones_like(param)), name


def test_weights_are_created_in_fp32(make_model):
    assert {p.dtype for p in make_model().parameters()} == {torch.float32}


def test_tied_head_shares_the_embedding_tensor(make_model):
    model = make_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        model.tok_embeddings.weight[3, 0] = 42.0
    assert model.output.weight[3, 0] == 42.0
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for n, p in model.named_parameters() if n != "output.weight"
    )
    untied = make_model(tie_embeddings=False)
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()


def test_every_parameter_gets_a_gradient(make_model):
    model = make_model(qk_norm=True, tie_embeddings=False).train()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    model(ids).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_bf16_autocast_keeps_fp32_weights_and_stays_close_to_fp32(make_model):
    model = make_model()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    full = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(ids, torch.zeros_like(ids))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert (mixed.float() - full).abs().max() < 0.05 * full.abs().max()


# -- feed-forward layers from a third-party plugin ------------------------------------------------


@attrs.define
class ScaledOptions:
    scale: float = 2.0


class ScaledMLP(nn.Module):
    """A plugin's feed-forward layer: ``scale * up(relu(down(x)))``, no init_weights of its own."""

    def __init__(self, dim: int, scale: float, layer_index: int) -> None:
        super().__init__()
        self.layer_index, self.scale = layer_index, scale
        self.inner = nn.Sequential(nn.Linear(dim, 512, bias=False), nn.ReLU(), nn.Linear(512, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.inner(x)


class SelfInitMLP(ScaledMLP):
    """The same layer, initialising itself: records what the model asked for."""

    def init_weights(self, init) -> None:
        self.init_args = (init.std, init.residual_std)
        init.zeros(self.inner[0].weight)
        init.normal(self.inner[2].weight, init.residual_std)


class FeedForwardPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def forge_lm_register_feed_forwards(self, register):
        register(
            "scaled_mlp", lambda o, dim, i: ScaledMLP(dim, o.scale, i), config=ScaledOptions, description="Scaled MLP"
        )
        register(
            "self_init_mlp",
            lambda o, dim, i: SelfInitMLP(dim, o.scale, i),
            config=ScaledOptions,
            description="Self-initialising MLP",
        )
        register("not_a_module", lambda o, dim, i: "oops", description="Returns a string")


@pytest.fixture
def plugin_registry(manager):
    info = manager.add_plugin(FeedForwardPlugin(), "ffn-plugin", distribution="forge-ffn-example")
    assert info.status is PluginStatus.OK, info.reason
    return manager.registry


def test_a_plugin_feed_forward_is_built_for_every_layer_with_its_index(plugin_registry):
    config = ModelSection(
        dim=32, n_layers=3, n_heads=4, init_std=0.1, ffn=ComponentConfig("scaled_mlp", ScaledOptions(3.0))
    )
    torch.manual_seed(0)
    model = build_model(config, VOCAB, plugin_registry)
    layers = [block.feed_forward for block in model.layers]
    assert [type(f) for f in layers] == [ScaledMLP] * 3
    assert [f.layer_index for f in layers] == [0, 1, 2]
    assert [f.scale for f in layers] == [3.0] * 3
    # Without init_weights, every Linear of the layer gets normal(0, init_std).
    weight = layers[0].inner[0].weight
    assert abs(weight.std().item() - 0.1) < 0.05 * 0.1
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, VOCAB)


def test_a_plugin_feed_forward_with_init_weights_initialises_itself(plugin_registry):
    config = ModelSection(dim=32, n_layers=2, n_heads=4, init_std=0.1, ffn=ComponentConfig("self_init_mlp"))
    model = build_model(config, VOCAB, plugin_registry)
    for block in model.layers:
        assert block.feed_forward.init_args == pytest.approx((0.1, 0.1 / math.sqrt(4)))
        assert torch.equal(block.feed_forward.inner[0].weight, torch.zeros(512, 32))
        assert block.feed_forward.scale == 2.0  # unset options are the component's defaults


def test_a_feed_forward_factory_returning_no_module_is_a_plugin_error(plugin_registry):
    config = ModelSection(dim=32, n_layers=1, n_heads=4, ffn=ComponentConfig("not_a_module"))
    with pytest.raises(PluginError, match=r"returned str for layer 0, not a torch\.nn\.Module"):
        build_model(config, VOCAB, plugin_registry)
