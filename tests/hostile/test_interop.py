"""Hostile Hugging Face model directories for ``forge import-hf``: JSON that is not JSON or not
a model's config, shard lists that lead out of the directory, damaged weights. Each is refused
with exit 2 and a message naming the file, before a run directory is created."""

from __future__ import annotations

import json
import shutil
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
        _ERR + r"'.*/hf': config\.json does not describe a Llama model Forge can import: KeyError",
        with_hf(config_edit(lambda c: c.pop("hidden_size"))),
        check=nothing_imported,
    ),
    Case(
        "config-hidden-size-a-string",
        IMPORT,
        2,
        _ERR + r"'.*/hf': config\.json does not describe a Llama model Forge can import: TypeError",
        with_hf(config_edit(lambda c: c.update(hidden_size="32"))),
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
]


@pytest.fixture(autouse=True)
def _hf_source(hf_model: Path) -> None:
    HF_SOURCE[:] = [hf_model]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)
