"""Meta-device build and layout-independent initialisation (forge_lm.model.init).

Under torchrun the training loop builds the model on the meta device, transforms it, and
materializes each rank's shards only; the initial values depend on the seed and parameter
names alone. Checked here: on 2 CPU ranks, the FSDP2, tensor-parallel, pipeline and
expert-parallel builds equal the one-process model bit for bit; building on 2 ranks grows each
rank's peak memory by about half of what one process needs; and, in one process, the rules
plugin modules follow (init_weights(init), the default rule, what is refused).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from forge_lm.config import ComponentConfig, ModelSection
from forge_lm.errors import PluginError
from forge_lm.model import build_model
from forge_lm.model.init import Initializer, initialize, materialize
from forge_lm.testing.distributed import torchrun

WORKER = Path(__file__).parent / "workers" / "meta_init_worker.py"
VOCAB = 257


def _run(args: list[str], nproc: int) -> None:
    result = torchrun([str(WORKER), *args], nproc=nproc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# -- 2 ranks ---------------------------------------------------------------------------------------


def test_sharded_builds_start_from_the_one_process_weights(tmp_path: Path) -> None:
    """FSDP2 and TP (tied embeddings, an uneven vocabulary split), pipeline stages and forge-moe's
    experts over ep = 2 (then also FSDP2, as _StridedShard): every tensor each rank holds,
    gathered whole, is the one-process model's, and each rank allocated only its part."""
    cases = ["fsdp2", "tp", "pp"]
    if importlib.util.find_spec("forge_moe") is not None:
        cases.append("ep")
    out = tmp_path / "equal.json"
    _run(["equal", str(out), *cases], nproc=2)
    ranks = json.loads(out.read_text())
    for rank, results in enumerate(ranks):
        for case in cases:
            result = results[case]
            assert result["mismatched"] == [], (rank, case)
            if case == "pp":
                assert result["stage_blocks"] == ([0, 1] if rank == 0 else [2, 3])
            else:
                assert result["compared"] == result["reference_tensors"], (rank, case)
                assert result["placements"], case  # the parameters really are DTensors
            # No rank allocated the whole model: about half of it each (norms are replicated under TP).
            assert 0.45 < result["local_fraction"] < 0.55, (rank, case, result["local_fraction"])
        assert results["fsdp2"]["tied"]  # still one tensor after to_empty
        assert results["tp"]["tied"]
    assert sum(r["pp"]["compared"] for r in ranks) == ranks[0]["pp"]["reference_tensors"] + 2  # RoPE on both


def test_building_on_two_ranks_takes_about_half_the_peak_memory_of_one_process(tmp_path: Path) -> None:
    """Peak resident memory while the loop builds a 1024-wide, 3-layer model (153 MB of fp32
    parameters): with FSDP2 on 2 ranks each rank's peak grows by about half of one process's.

    Measured as ``ru_maxrss`` (the kernel's high-water mark of resident memory, which sees
    every allocation, torch's included) after the build minus the resident memory just before,
    once the process has built a tiny model of the same layout (so the process group, imports
    and allocator pools are not counted). Large tensors are mmapped and given back when freed,
    so the high-water mark is the build's own peak. Measured 158 MB in one process, 88 MB per
    rank on 2 (the shard, 76 MB, plus one chunk of random values and its copy); a build that
    allocated the whole model on each rank would be at 1.0 or above. Bound: 0.7."""
    model = ["--model.dim=1024", "--model.n_layers=3", "--model.n_heads=8"]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    _run(["memory", str(tmp_path / "one" / "memory.json"), *model], nproc=1)
    _run(["memory", str(tmp_path / "two" / "memory.json"), *model], nproc=2)
    [one] = json.loads((tmp_path / "one" / "memory.json").read_text())
    two = json.loads((tmp_path / "two" / "memory.json").read_text())
    assert one["local_bytes"] > 150e6  # the model is large enough to stand out from the interpreter
    assert one["peak_growth"] > 0.9 * one["local_bytes"]  # the measurement sees the model being built
    for rank in two:
        assert rank["local_bytes"] == pytest.approx(one["local_bytes"] / 2, rel=0.01)
        ratio = rank["peak_growth"] / one["peak_growth"]
        assert ratio < 0.7, (rank, one)


# -- one process -----------------------------------------------------------------------------------


def _section(**fields: object) -> ModelSection:
    base: dict[str, object] = {"dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 16, "init_std": 0.1}
    return ModelSection(**{**base, **fields})


def _equal_models(a: nn.Module, b: nn.Module) -> None:
    mine, theirs = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert list(mine) == list(theirs)
    for name, value in mine.items():
        assert torch.equal(value, theirs[name]), name
    for (name, buffer), (_, other) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert torch.equal(buffer, other), name


def test_a_value_depends_on_the_seed_and_its_name_only(manager):
    two = build_model(_section(n_layers=2), VOCAB, manager.registry, seed=5)
    four = build_model(_section(n_layers=4), VOCAB, manager.registry, seed=5)
    # The same name, the same std: the same values, however many layers come after.
    assert torch.equal(two.layers[1].attention.wq.weight, four.layers[1].attention.wq.weight)
    assert torch.equal(two.tok_embeddings.weight, four.tok_embeddings.weight)
    # Names differ: values differ; the seed changes everything.
    assert not torch.equal(four.layers[1].attention.wq.weight, four.layers[2].attention.wq.weight)
    other = build_model(_section(n_layers=2), VOCAB, manager.registry, seed=6)
    assert not torch.equal(two.layers[1].attention.wq.weight, other.layers[1].attention.wq.weight)


def test_the_seed_defaults_to_the_one_torch_manual_seed_set(manager):
    torch.manual_seed(11)
    seeded = build_model(_section(), VOCAB, manager.registry)
    _equal_models(seeded, build_model(_section(), VOCAB, manager.registry, seed=11))


@pytest.mark.parametrize("tied", [True, False])
def test_a_meta_build_materialized_equals_the_direct_build(manager, tied):
    direct = build_model(_section(tie_embeddings=tied, qk_norm=True), VOCAB, manager.registry, seed=3)
    meta = build_model(_section(tie_embeddings=tied, qk_norm=True), VOCAB, manager.registry, seed=3, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, torch.device("cpu"), seed=3)
    _equal_models(meta, direct)  # the RoPE tables too: buffers are recomputed, not left empty
    assert meta.tied is tied


def test_values_are_drawn_in_chunks_of_rows_each_from_its_own_generator(monkeypatch):
    """The definition the sharded fill relies on: chunk c of a tensor is a function of (seed,
    name, c), so a rank can draw only the chunks it needs."""
    from forge_lm.model import init

    monkeypatch.setattr(init, "CHUNK_ELEMENTS", 30)  # rows of 10: 3 rows per chunk
    module = nn.Linear(10, 7, bias=False)
    initializer = Initializer(module, seed=9, std=1.0)
    initializer.normal(module.weight, 1.0)
    chunks = []
    for chunk, rows in enumerate((3, 3, 1)):
        generator = torch.Generator().manual_seed(init._seed_of(9, "weight", chunk))
        chunks.append(torch.empty(rows, 10).normal_(0.0, 1.0, generator=generator))
    assert torch.equal(module.weight.detach(), torch.cat(chunks))


class _Counter(nn.Module):
    """A plugin layer with a bias, a norm, a raw parameter and a buffer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)  # the default rule: weight normal, bias 0
        self.norm = nn.LayerNorm(dim)  # ones, bias 0
        self.scale = nn.Parameter(torch.empty(dim))
        self.register_buffer("seen", torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)) * self.scale


class _SelfInitialising(_Counter):
    def init_weights(self, init) -> None:
        init.module(self.proj)
        init.module(self.norm)
        init.constant(self.scale, 0.5)
        init.zeros(self.seen)


class _Legacy(_Counter):
    def init_weights(self, std: float, residual_std: float) -> None:
        nn.init.normal_(self.proj.weight, std=std)


def test_a_module_sets_its_tensors_through_init_and_children_get_the_default_rule():
    layer = _SelfInitialising(64)
    initialize(layer, seed=0, std=0.1)
    assert abs(layer.proj.weight.std().item() - 0.1) < 0.01
    assert torch.equal(layer.proj.bias, torch.zeros(64))
    assert torch.equal(layer.norm.weight, torch.ones(64))
    assert torch.equal(layer.norm.bias, torch.zeros(64))
    assert torch.equal(layer.scale, torch.full((64,), 0.5))
    assert torch.equal(layer.seen, torch.zeros(64))


def test_a_tensor_no_rule_sets_is_named():
    """The default rule knows linear, embedding and norm layers; a raw parameter or a buffer
    needs the module's init_weights (after to_empty it would hold garbage)."""
    with pytest.raises(PluginError, match=r"no initialisation rule set scale, seen\. .*init_weights\(init\)"):
        initialize(_Counter(8), seed=0, std=0.1)


def test_the_earlier_init_weights_form_is_refused_with_what_to_change():
    with pytest.raises(PluginError, match=r"_Legacy\.init_weights takes \(std, residual_std\).*Initializer"):
        initialize(_Legacy(8), seed=0, std=0.1)


def test_a_plugin_feed_forward_without_init_weights_builds_sharded_alike(manager):
    """A third-party layer without init_weights, built on meta and materialized, gets the same
    values as in one process: the default rule goes through the same per-name generators."""

    class Plugin:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        def forge_lm_register_feed_forwards(self, register):
            register(
                "biased_mlp",
                lambda options, dim, index: nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
                description="an MLP with biases",
            )

    manager.add_plugin(Plugin(), "biased-mlp")
    section = _section(ffn=ComponentConfig("biased_mlp"))
    direct = build_model(section, VOCAB, manager.registry, seed=1)
    meta = build_model(section, VOCAB, manager.registry, seed=1, device="meta")
    materialize(meta, torch.device("cpu"), seed=1)
    _equal_models(meta, direct)
    assert torch.equal(direct.layers[0].feed_forward[0].bias, torch.zeros(64))
