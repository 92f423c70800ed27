"""Pipeline parallelism's rules are caught by ``forge config validate``, before any process starts,
and the README's ``--distributed.pp=2`` example passes them as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forge_lm.cli import main
from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims

ROOT = Path(__file__).resolve().parents[3]
DEBUG = str(ROOT / "configs" / "debug.toml")


def _readme_pp_overrides() -> list[str]:
    """The overrides the README's "Distributed training" section gives for ``--distributed.pp=2``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### Distributed training") :]
    match = re.search(r"`--distributed\.pp=2` \(with (.*?)\)", section, re.DOTALL)
    assert match, "the README's Distributed training section no longer shows --distributed.pp=2 (with ...)"
    return ["--distributed.pp=2", *re.findall(r"`(--[\w.]+=[^`]+)`", match.group(1))]


def test_the_readmes_pp_example_validates_as_written(capsys):
    overrides = _readme_pp_overrides()
    assert main(["config", "validate", DEBUG, *overrides]) == 0, capsys.readouterr().err
    assert "is valid" in capsys.readouterr().out


def test_the_readmes_pp_example_resolves_on_the_two_ranks_it_is_launched_with(manager):
    # The README launches it with torchrun --nproc_per_node=2: 2 stages, one rank each.
    config = load_config(DEBUG, _readme_pp_overrides(), manager.registry)
    dims = ParallelDims.resolve(config, 2)
    assert (dims.pp, dims.dp_shard, dims.pp_schedule) == (2, 1, "1f1b")


def test_validate_refuses_1f1b_with_fewer_microbatches_than_stages(capsys):
    code = main(["config", "validate", DEBUG, "--distributed.pp=2", "--model.tie_embeddings=false"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "forge: error: [distributed] the 1f1b schedule needs at least pp = 2 microbatches; raise [train] "
        "grad_accum_steps (now 1) or use pp_schedule = 'gpipe'."
    )


@pytest.mark.parametrize(
    "fix", [("--train.grad_accum_steps=2",), ("--distributed.pp_schedule=gpipe",)], ids=["accum", "gpipe"]
)
def test_either_fix_the_message_names_validates(capsys, fix):
    code = main(["config", "validate", DEBUG, "--distributed.pp=2", "--model.tie_embeddings=false", *fix])
    assert code == 0, capsys.readouterr().err
