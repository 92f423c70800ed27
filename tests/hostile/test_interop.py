"""Hostile Hugging Face model directories for ``forge import-hf``: JSON that is not JSON or not
a model's config, config fields of the wrong type or value, sizes too large for this host or that
disagree with the weights, shard lists that lead out of the directory, damaged weights, a plugin
whose conversion returns an unusable table. Each is refused with exit 2 and a message naming the
file, the field or the plugin, before a run directory is created. And for ``forge export-hf``, an
output directory holding links, an earlier export, or a file in its place: refused (exit 2)
before anything is written."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from _hostile import Case, Workspace, case_params

from forge_lm.cli._main import main


@pytest.fixture(scope="module")
def hf_model(trained_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile-hf") / "hf"
    assert main(["export-hf", str(trained_run), str(out)]) == 0
    return out


IMPORT = ("import-hf", "{root}/hf", "--train.output_dir={root}/imported")


def with_hf(edit):
    def setup(ws: Workspace) -> None:
        shutil.copytree(HF_SOURCE[0], ws.root / "hf")
        edit(ws.root / "hf", ws)

    return setup


def write(name: str, data: bytes | str):
    def edit(hf: Path, ws: Workspace) -> None:
        (hf / name).write_bytes(data.encode() if isinstance(data, str) else data)

    return edit


def config_edit(change):
    def edit(hf: Path, ws: Workspace) -> None:
        config = json.loads((hf / "config.json").read_text())
        change(config)
        (hf / "config.json").write_text(json.dumps(config))

    return edit


def sharded(shard_name: str):
    """Weights listed by an index whose shard is ``shard_name`` (relative to the directory)."""

    def edit(hf: Path, ws: Workspace) -> None:
        weights = hf / "model.safetensors"
        secret = ws.root / "secret.safetensors"
        shutil.copy(weights, secret)
        weights.unlink()
        names = json.loads(secret.read_bytes()[8 : 8 + int.from_bytes(secret.read_bytes()[:8], "little")])
        index = {"weight_map": {name: shard_name for name in names if name != "__metadata__"}}
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def link_shard(hf: Path, ws: Workspace) -> None:
    weights = hf / "model.safetensors"
    outside = ws.root / "outside.safetensors"
    shutil.move(weights, outside)
    (hf / "shard-1.safetensors").symlink_to(outside)
    names = json.loads(outside.read_bytes()[8 : 8 + int.from_bytes(outside.read_bytes()[:8], "little")])
    index = {"weight_map": {name: "shard-1.safetensors" for name in names if name != "__metadata__"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def nothing_imported(ws: Workspace, outcome) -> None:
    assert not (ws.root / "imported").exists()


def hf_import_plugin(body: str):
    """A setup installing ``forge-hostile`` 1.0 (entry point ``hostile``), whose module defines
    ``forge_lm_hf_import`` as ``body``, into the case's plugin site (``{root}/site``), and the
    model directory ``{root}/hf``."""

    def setup(ws: Workspace) -> None:
        with_hf(lambda hf, ws: None)(ws)
        site = ws.root / "site"
        header = 'from forge_lm import hookimpl\nFORGE_LM_PLUGIN_API = ">=1,<2"\n\n@hookimpl\n'
        (site / "forge_hostile.py").write_text(header + textwrap.dedent(body).lstrip())
        info = site / "forge_hostile-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-hostile\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text("[forge_lm]\nhostile = forge_hostile\n")
        importlib.invalidate_caches()

    return setup


EXPORT = ("export-hf", "{run}", "{root}/out")
VICTIM = "mine, not an export's\n"


def link_in_out(name: str):
    """An export directory ``{root}/out`` whose ``name`` is a link to the file ``{root}/victim``."""

    def setup(ws: Workspace) -> None:
        (ws.root / "victim").write_text(VICTIM)
        (ws.root / "out").mkdir()
        (ws.root / "out" / name).symlink_to(ws.root / "victim")

    return setup


def victim_kept_and_nothing_written(ws: Workspace, outcome) -> None:
    assert (ws.root / "victim").read_text() == VICTIM
    assert [path.name for path in (ws.root / "out").iterdir() if not path.is_symlink()] == []


def out_a_file(ws: Workspace) -> None:
    (ws.root / "out").write_text(VICTIM)


def file_kept(ws: Workspace, outcome) -> None:
    assert (ws.root / "out").read_text() == VICTIM


def previous_export(ws: Workspace) -> None:
    shutil.copytree(HF_SOURCE[0], ws.root / "out")
    (ws.root / "out" / "model-00001-of-00002.safetensors").write_bytes(b"an older shard")


def previous_export_kept(ws: Workspace, outcome) -> None:
    for path in HF_SOURCE[0].iterdir():
        assert (ws.root / "out" / path.name).read_bytes() == path.read_bytes(), path.name
    assert (ws.root / "out" / "model-00001-of-00002.safetensors").read_bytes() == b"an older shard"


HF_SOURCE: list[Path] = []  # filled by the autouse fixture below (case setups run inside the test)

_ERR = r"forge: error: "
CASES = [
    Case("missing-directory", IMPORT, 2, _ERR + r"'.*/hf' has no config\.json", check=nothing_imported),
    Case(
        "config-not-json", IMPORT, 2, _ERR + r"'.*config\.json' is not valid JSON", with_hf(write("config.json", "{"))
    ),
    Case(
        "config-not-utf8",
        IMPORT,
        2,
        _ERR + r"'.*config\.json' is not valid JSON",
        with_hf(write("config.json", b"\xff")),
    ),
    Case(
        "config-a-list", IMPORT, 2, _ERR + r"'.*config\.json' is not a JSON object", with_hf(write("config.json", "[]"))
    ),
    Case(
        "config-missing-hidden-size",
        IMPORT,
        2,
        _ERR + r"'.*/hf': config\.json does not describe a Llama model Forge can import: it has no hidden_size\. "
        r"Correct hidden_size in config\.json",
        with_hf(config_edit(lambda c: c.pop("hidden_size"))),
        check=nothing_imported,
    ),
    Case(
        "config-hidden-size-a-string",
        IMPORT,
        2,
        _ERR + r"'.*/hf': config\.json does not describe a Llama model Forge can import: hidden_size is '32', not a "
        r"positive integer\.",
        with_hf(config_edit(lambda c: c.update(hidden_size="32"))),
        check=nothing_imported,
    ),
    # -- numbers of config.json that size the model: checked before anything is built ----------------
    Case(
        "config-huge-hidden-size",
        IMPORT,
        2,
        _ERR + r"'.*/hf/config\.json' describes a model that needs (about|at least) [\d.,]+ [kMGTPE]?B for its "
        r"weights and optimizer state, more than the [\d.,]+ [kMGTPE]?B of available memory on this host",
        with_hf(config_edit(lambda c: (c.update(hidden_size=2**36, intermediate_size=2**38), c.pop("head_dim")))),
        check=nothing_imported,
    ),
    Case(
        "config-intermediate-size-not-the-weights",
        IMPORT,
        2,
        _ERR + r"the weights in '.*/hf' do not fit the model that its config\.json describes \(as plugin "
        r"'core\.hf_llama' .*\): layers\.0\.feed_forward\.w1\.weight is \[\d+, 32\], the model's is \[\d+, 32\]",
        with_hf(config_edit(lambda c: c.update(intermediate_size=c["intermediate_size"] + 32))),
        check=nothing_imported,
    ),
    Case(
        "config-heads-zero",
        IMPORT,
        2,
        _ERR + r"'.*/hf': config\.json does not describe a Llama model Forge can import: num_attention_heads is 0, "
        r"not a positive integer\. Correct num_attention_heads in config\.json",
        with_hf(config_edit(lambda c: c.update(num_attention_heads=0))),
        check=nothing_imported,
    ),
    Case(
        "config-rope-parameters-not-a-table",
        IMPORT,
        2,
        _ERR + r"'.*/hf': config\.json does not describe a Llama model Forge can import: rope_parameters is \[1\], "
        r"not a table",
        with_hf(config_edit(lambda c: c.update(rope_parameters=[1]))),
        check=nothing_imported,
    ),
    Case(
        "config-intermediate-size-a-float",
        IMPORT,
        2,
        _ERR + r"'.*/hf': config\.json does not describe a Llama model Forge can import: intermediate_size is 64\.5, "
        r"not a positive integer\.",
        with_hf(config_edit(lambda c: c.update(intermediate_size=64.5))),
        check=nothing_imported,
    ),
    Case(
        "plugin-table-without-max-seq-len",
        IMPORT,
        2,
        _ERR + r"plugin 'hostile' \(forge-hostile 1\.0\) converted '.*/hf/config\.json' with forge_lm_hf_import into "
        r"an unusable \[model\] table or state dict: no max_seq_len\. This is a bug in the plugin: .*"
        r"--block-plugin hostile",
        hf_import_plugin(
            """
            def forge_lm_hf_import(hf_config, state):
                return {"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 257}, {}
            """
        ),
        check=nothing_imported,
    ),
    Case(
        "weights-not-safetensors",
        IMPORT,
        2,
        _ERR + r"'.*model\.safetensors' is not a readable safetensors file",
        with_hf(write("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")),
        check=nothing_imported,
    ),
    Case(
        "no-weights",
        IMPORT,
        2,
        _ERR + r"'.*/hf' has neither model\.safetensors nor",
        with_hf(lambda hf, ws: (hf / "model.safetensors").unlink()),
    ),
    Case(
        "index-shard-up-and-out",
        IMPORT,
        2,
        _ERR + r"'.*index\.json' names the shard '\.\./secret\.safetensors', which is not a file in",
        with_hf(sharded("../secret.safetensors")),
        check=nothing_imported,
    ),
    Case(
        "index-shard-absolute",
        IMPORT,
        2,
        _ERR + r"'.*index\.json' names the shard '/.*', which is not a file in",
        with_hf(sharded("/etc/hostname")),
    ),
    Case(
        "index-shard-is-a-link",
        IMPORT,
        2,
        _ERR + r"'.*index\.json' names the shard 'shard-1\.safetensors', which is not a file in",
        with_hf(link_shard),
    ),
    Case(
        "index-not-a-map",
        IMPORT,
        2,
        _ERR + r"'.*index\.json' has no weight_map",
        with_hf(
            lambda hf, ws: ((hf / "model.safetensors").unlink(), write("model.safetensors.index.json", "[1]")(hf, ws))
        ),
    ),
    # -- forge export-hf: what is already in OUT_DIR ---------------------------------------------------
    Case(
        "export-config-is-a-link",
        EXPORT,
        2,
        _ERR + r"'.*/out/config\.json' is a symbolic link \(to '.*/victim'\); an export does not write through links",
        link_in_out("config.json"),
        needs_run=True,
        check=victim_kept_and_nothing_written,
    ),
    Case(
        "export-tokenizer-is-a-link",
        EXPORT,
        2,
        _ERR + r"'.*/out/tokenizer\.json' is a symbolic link \(to '.*/victim'\); an export does not write through",
        link_in_out("tokenizer.json"),
        needs_run=True,
        check=victim_kept_and_nothing_written,
    ),
    Case(
        "export-into-a-file",
        EXPORT,
        2,
        _ERR + r"'.*/out' exists and is not a directory",
        out_a_file,
        needs_run=True,
        check=file_kept,
    ),
    Case(
        "export-over-an-export",
        EXPORT,
        2,
        _ERR
        + r"'.*/out' already holds an export \(config\.json, model-00001-of-00002\.safetensors, model\.safetensors, "
        r"special_tokens_map\.json, tokenizer\.json, tokenizer_config\.json\); export-hf does not overwrite it\. "
        r"Choose another directory, or pass --force",
        previous_export,
        needs_run=True,
        check=previous_export_kept,
    ),
]


@pytest.fixture(autouse=True)
def _hf_source(hf_model: Path) -> None:
    HF_SOURCE[:] = [hf_model]


@pytest.fixture(autouse=True)
def _plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The case's plugin site (``{root}/site``) on ``sys.path``; its modules forgotten afterwards."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))  # also invalidates importlib's caches
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(site)):
            del sys.modules[name]
    importlib.invalidate_caches()


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)
