"""The Hugging Face conversion hooks: the core's Llama conversion is an ordinary plugin
(``core.hf_llama``) asked after every other one, it declines what it cannot convert so that
``forge export-hf`` / ``forge import-hf`` say no installed plugin converts it, and Llama and
Mixtral rename their shared weights through one helper."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from forge_lm.cli._main import main
from forge_lm.config import load_config
from forge_lm.errors import ForgeError
from forge_lm.hookspecs import hookimpl
from forge_lm.model.hf import export_hf, export_with_plugins, import_with_plugins, rename_from_hf, rename_to_hf
from forge_lm.model.hf import llama as hf
from forge_lm.plugins import PluginHookFailed, PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train

from .conftest import VOCAB

transformers = pytest.importorskip("transformers")  # a development dependency: the independent reference

CORE = "core.hf_llama"
TOY_STATE = {"toy.weight": torch.arange(6.0).reshape(2, 3)}


class Exporter:
    """A third-party plugin's forge_lm_hf_export: records each call, answers ``answer``."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, name: str, calls: list[str], answer: object) -> None:
        self.name, self.calls, self.answer = name, calls, answer

    @hookimpl
    def forge_lm_hf_export(self, model, config):
        self.calls.append(self.name)
        return self.answer


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """The conversions asked, in order; the core's is recorded as 'core' and still runs."""
    asked: list[str] = []
    core = hf.llama_export

    def recorded(model, config, **token_ids):
        asked.append("core")
        return core(model, config, **token_ids)

    monkeypatch.setattr(hf, "llama_export", recorded)  # core.hf_llama imports it when called
    return asked


def test_the_core_conversion_is_a_trylast_hookimpl_of_a_builtin_plugin(manager):
    for hook in ("forge_lm_hf_export", "forge_lm_hf_import"):
        (impl,) = getattr(manager.hook, hook).get_hookimpls()
        assert (impl.plugin_name, impl.trylast) == (CORE, True), hook
    assert manager.plugin(CORE).builtin


def test_a_third_party_export_is_asked_before_the_core_and_wins(manager, make_model, calls, tmp_path):
    toy_config = {"architectures": ["ToyForCausalLM"], "model_type": "toy"}
    manager.add_plugin(Exporter("toy", calls, (toy_config, TOY_STATE)), "toy", distribution="forge-toy")
    model = make_model()  # a dense SwiGLU model, which the core would convert too

    out = export_with_plugins(manager, model, model.config, tmp_path / "hf", eos_id=5)

    assert calls == ["toy"]  # the core was never asked
    assert json.loads((out / "config.json").read_text()) == {**toy_config, "eos_token_id": 5}
    from safetensors.torch import load_file

    assert torch.equal(load_file(out / "model.safetensors")["toy.weight"], TOY_STATE["toy.weight"])


def test_when_third_parties_decline_the_core_answers_after_them(manager, make_model, calls, tmp_path):
    manager.add_plugin(Exporter("first", calls, None), "first", distribution="forge-first")
    manager.add_plugin(Exporter("second", calls, None), "second", distribution="forge-second")
    model = make_model()

    out = export_with_plugins(manager, model, model.config, tmp_path / "hf")

    assert calls == ["second", "first", "core"]  # pluggy asks the newest plugin first; the core last
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_the_core_declines_a_model_whose_feed_forward_is_not_its_swiglu(manager):
    class Plain(torch.nn.Module):  # any other plugin's feed-forward
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 4, bias=False)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].feed_forward = Plain()
    assert hf.llama_export(model, config=None) is None  # decided by the layers, before the config is read
    assert manager.call_first("forge_lm_hf_export", model=model, config=None) is None


def test_the_core_declines_model_types_other_than_llama(manager):
    for hf_config in ({"model_type": "mistral", "hidden_size": 32}, {}):
        assert hf.llama_import(hf_config, state={}) is None
        assert manager.call_first("forge_lm_hf_import", hf_config=hf_config, state={}) is None


def test_a_model_the_core_claims_but_llama_cannot_express_is_refused_as_the_users_mistake(manager, make_model):
    model = make_model(norm="layernorm")
    with pytest.raises(ForgeError, match=r"no Hugging Face LlamaForCausalLM equivalent: \[model\] norm") as caught:
        export_with_plugins(manager, model, model.config, "unused")
    assert not isinstance(caught.value, PluginHookFailed)  # not reported as a bug of core.hf_llama


# -- from the command line ------------------------------------------------------------------------

GELU_PLUGIN = """
from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


def build(options, dim, layer_index):
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(dim, 2 * dim, bias=False), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim, bias=False)
    )


@hookimpl
def forge_lm_register_feed_forwards(register):
    register("gelu_mlp", build, description="GELU MLP, with no Hugging Face conversion")
"""
TINY = (
    *TINY_MODEL,
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--train.max_steps=1",
    '--metrics.backends=["jsonl"]',
    "--eval.interval=0",
    "--checkpoint.interval=0",
    "--data.name=synthetic",
)


def test_export_hf_says_no_installed_plugin_converts_a_model_of_another_feed_forward(fake_site, tmp_path, capsys):
    fake_site.install("forge-gelu", GELU_PLUGIN)
    manager = PluginManager(PluginSettings(allow=("gelu",)))
    run_dir = tmp_path / "run"
    overrides = [*TINY, "--model.ffn.name=gelu_mlp", f"--train.output_dir={run_dir}"]
    train(load_config(None, overrides, manager.registry), manager)
    capsys.readouterr()

    assert main(["--plugins", "gelu", "export-hf", str(run_dir), str(tmp_path / "hf")]) == 2

    version = manager.plugin(CORE).version
    assert capsys.readouterr().err == (
        "forge: error: this model has no Hugging Face equivalent that an installed plugin writes: its "
        "feed-forward is [model.ffn] name = 'gelu_mlp', and no plugin's forge_lm_hf_export converts it (asked: "
        f"plugin '{CORE}' (forge-lm {version})). Keep it in Forge's own checkpoint format, or install the plugin "
        "that converts such models.\n"
    )
    assert not (tmp_path / "hf").exists()


def test_import_hf_says_no_installed_plugin_imports_another_model_type(make_model, manager, tmp_path, capsys):
    model = make_model()
    out = export_hf(model, model.config, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))

    with pytest.raises(ForgeError, match="model_type 'mistral', which no installed plugin imports"):
        import_with_plugins(manager, out)
    assert main(["--no-plugin-autoload", "import-hf", str(out), f"--train.output_dir={tmp_path / 'run'}"]) == 2

    assert capsys.readouterr().err == (
        f"forge: error: '{out / 'config.json'}' has model_type 'mistral', which no installed plugin imports "
        f"(asked: plugin '{CORE}' (forge-lm {manager.plugin(CORE).version})). Install the plugin that converts "
        "that model type; forge list-plugins shows what is installed.\n"
    )
    assert not (tmp_path / "run").exists()


# -- the renaming Llama and Mixtral share -----------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_the_shared_renaming_maps_every_parameter_of_a_dense_model_exactly_once(make_model, tied):
    model = make_model(n_kv_heads=2, tie_embeddings=tied)
    names = list(model.state_dict())
    # One distinct marker per Forge name, so each HF tensor says which Forge name it came from.
    markers = {name: torch.tensor(float(i)) for i, name in enumerate(names)}

    renamed = rename_to_hf(markers, hf._llama_ffn_to_hf, architecture="LlamaForCausalLM")

    sources = collections.Counter(int(tensor) for tensor in renamed.values())
    assert sources == collections.Counter(range(len(names)))  # none left out, none mapped twice
    # The names are exactly those of transformers' own model of the same shape.
    reference = transformers.LlamaForCausalLM(hf.to_hf_config(model.config, VOCAB, hf.swiglu_hidden_of(model)))
    assert set(renamed) == set(reference.state_dict())
    # And back: every HF name returns to the Forge name it came from.
    back = rename_from_hf(renamed, hf._llama_ffn_from_hf, architecture="LlamaForCausalLM")
    assert {name: int(tensor) for name, tensor in back.items()} == {name: i for i, name in enumerate(names)}


def test_the_shared_renaming_refuses_a_name_the_format_does_not_know():
    def no_feed_forward(index, name, tensor):
        return None

    with pytest.raises(ForgeError, match=r"parameter 'layers\.3\.feed_forward\.w1\.weight' has no Hugging Face Toy"):
        rename_to_hf({"layers.3.feed_forward.w1.weight": torch.zeros(1)}, no_feed_forward, architecture="Toy")
    with pytest.raises(ForgeError, match=r"weight 'model\.layers\.0\.mlp\.up_proj\.weight' is not part of a Toy"):
        rename_from_hf({"model.layers.0.mlp.up_proj.weight": torch.zeros(1)}, no_feed_forward, architecture="Toy")


@pytest.mark.parametrize(("model_type", "package"), [("deepseek_v3", "forge-deepseek"), ("mixtral", "forge-moe")])
def test_import_hf_names_the_first_party_plugin_that_converts_a_known_model_type(
    make_model, manager, tmp_path, model_type, package
):
    model = make_model()
    out = export_hf(model, model.config, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(ForgeError, match=f"The package {package} converts it: pip install {package}"):
        import_with_plugins(manager, out)
