"""Hostile and broken configs and command lines: impossible sizes, non-finite numbers, wrong
types, files that are not TOML, unknown names, components of blocked or disabled plugins, shapes
that cannot be built. Each is refused before anything is built or written, with exit 2 and one
``forge: error:`` line that names the section and key (or the file, or the plugin switch) and
what is right; a run too large for this machine is refused within seconds, from an estimate, by
``forge config validate`` and ``forge train`` alike, without allocating it.
"""

from __future__ import annotations

import re

import pytest
from _hostile import Case, Outcome, Workspace, case_params
from _payloads import deeply_nested_toml

TRAIN = ("train", "{tiny}", "--train.max_steps=1", "--train.output_dir={root}/out")
VALIDATE = ("config", "validate")
TOO_BIG = (
    r"forge: error: the run needs (about|at least) [\d.,]+ [PTG]B of memory per rank, more than the [\d.,]+ [kMGTP]?B "
)
ON_THIS_HOST = r"of (available memory on this host|free memory on cuda)"  # the device this machine trains on


def toml(text: str, name: str = "run.toml"):
    """A setup writing ``text`` to ``{root}/<name>``."""

    def write(ws: Workspace) -> None:
        (ws.root / name).write_text(text, encoding="utf-8")

    return write


def write_bytes(data: bytes):
    def write(ws: Workspace) -> None:
        (ws.root / "run.toml").write_bytes(data)

    return write


def shard_with_metadata(metadata: str):
    """A token shard (``{root}/shards/a.npy``) whose metadata file holds ``metadata``."""

    def write(ws: Workspace) -> None:
        import numpy as np

        (ws.root / "shards").mkdir()
        np.save(ws.root / "shards" / "a.npy", np.arange(4096, dtype=np.uint16) % 257)
        (ws.root / "shards" / "a.json").write_text(metadata)

    return write


SHARDS = ("--data.name=memmap", "--data.path={root}/shards")


def make_directory(ws: Workspace) -> None:
    (ws.root / "run.toml").mkdir()


def env(**variables: str):
    def set_env(ws: Workspace) -> None:
        ws.env.update(variables)

    return set_env


def nothing_written(ws: Workspace, outcome: Outcome) -> None:
    assert not (ws.root / "out").exists(), "a refused run wrote its run directory"


def the_estimate_is_printed(ws: Workspace, outcome: Outcome) -> None:
    valid, estimate = outcome.stdout.splitlines()
    assert valid.endswith(" is valid.")
    assert re.match(r"estimate: [\d.]+[KMB]? parameters; about [\d.]+ [kMG]B per rank \(weights ", estimate), estimate


CASES = [
    # -- sizes that cannot fit: refused from the estimate, before anything is allocated --------------
    Case("huge-n-layers-validate", (*VALIDATE, "--model.n_layers=1000000000"), 2, TOO_BIG + ON_THIS_HOST),
    Case(
        "huge-n-layers-train", (*TRAIN, "--model.n_layers=1000000000"), 2, TOO_BIG + ON_THIS_HOST, check=nothing_written
    ),
    Case("huge-dim-train", (*TRAIN, "--model.dim=1000000", "--model.n_heads=1000"), 2, TOO_BIG, check=nothing_written),
    Case("huge-vocab-validate", (*VALIDATE, "--model.vocab_size=100000000000"), 2, TOO_BIG),
    Case("huge-rope-tables-train", (*TRAIN, "--model.max_seq_len=100000000000"), 2, TOO_BIG, check=nothing_written),
    Case("huge-feed-forward-train", (*TRAIN, "--model.ffn.multiple_of=1000000000"), 2, TOO_BIG, check=nothing_written),
    Case(
        "huge-moe-experts-train",
        (*TRAIN, "--model.ffn.name=moe", "--model.ffn.n_experts=100000000"),
        2,
        TOO_BIG,
        check=nothing_written,
    ),
    Case("huge-batch-train", (*TRAIN, "--train.batch_size=100000000"), 2, TOO_BIG, check=nothing_written),
    Case(
        "huge-n-layers-sharded-validate",
        (*VALIDATE, "--model.n_layers=1000000000", "--distributed.dp_shard=8", "--distributed.tp=2"),
        2,
        TOO_BIG,
    ),
    Case("default-validate-prints-the-estimate", VALIDATE, 0, "", check=the_estimate_is_printed),
    # -- numbers that are not numbers ------------------------------------------------------------
    Case(
        "lr-inf",
        (*VALIDATE, "--optimizer.lr=inf"),
        2,
        r"forge: error: \[optimizer\] lr: expected a finite number, got 'inf'\.$",
    ),
    Case(
        "lr-minus-inf",
        (*TRAIN, "--optimizer.lr=-inf"),
        2,
        r"forge: error: \[optimizer\] lr: expected a finite number, got '-inf'\.$",
    ),
    Case(
        "lr-nan",
        (*VALIDATE, "--optimizer.lr=nan"),
        2,
        r"forge: error: \[optimizer\] lr: expected a finite number, got 'nan'\.$",
    ),
    Case(
        "lr-overflows-float32",
        (*TRAIN, "--optimizer.lr=1e300"),
        2,
        r"forge: error: \[optimizer\] lr: expected a number of magnitude at most 3\.403e\+38 \(float32\), "
        r"got '1e300'\.$",
    ),
    Case(
        "lr-inf-in-toml",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[optimizer\] lr: expected a finite number, got float inf\.$",
        setup=toml("[optimizer]\nlr = inf\n"),
    ),
    Case(
        "weight-decay-inf",
        (*VALIDATE, "--optimizer.weight_decay=inf"),
        2,
        r"forge: error: \[optimizer\] weight_decay: expected a finite number, got 'inf'\.$",
    ),
    Case(
        "grad-clip-inf",
        (*TRAIN, "--train.grad_clip=inf"),
        2,
        r"forge: error: \[train\] grad_clip: expected a finite number",
    ),
    Case(
        "betas-nan",
        (*VALIDATE, "--optimizer.betas=[0.9, nan]"),
        2,
        r"forge: error: \[optimizer\] betas: expected a finite number, got float nan\.$",
    ),
    Case(
        "seed-beyond-64-bits",
        (*TRAIN, "--train.seed=99999999999999999999999"),
        2,
        r"forge: error: \[train\] seed: expected an integer between -2\*\*63 and 2\*\*63 - 1 \(64 bits\)",
    ),
    Case(
        "seed-beyond-32-bits",
        (*TRAIN, "--train.seed=9223372036854775807"),
        2,
        r"forge: error: \[train\] seed: must be between -2147483648 and 2147483647, got 9223372036854775807\.$",
    ),
    # -- wrong types: section, key, expected type and the value given -------------------------------
    Case(
        "string-vocab-size-in-toml",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[model\] vocab_size: expected an integer, got string '257'\.$",
        setup=toml('[model]\nvocab_size = "257"\n'),
    ),
    Case(
        "string-lr-in-toml",
        (*TRAIN, "{root}/run.toml"),
        2,
        r"forge: error: \[optimizer\] lr: expected a number, got string '1e-3'\.$",
        setup=toml('[optimizer]\nlr = "1e-3"\n'),
    ),
    Case(
        "string-bool-in-toml",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[train\] compile: expected true or false, got string 'yes'\.$",
        setup=toml('[train]\ncompile = "yes"\n'),
    ),
    Case(
        "float-steps-in-toml",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[train\] max_steps: expected an integer, got float 1000\.0\.$",
        setup=toml("[train]\nmax_steps = 1e3\n"),
    ),
    Case(
        "string-backends-in-toml",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[metrics\] backends: expected an array, got string 'jsonl'\.$",
        setup=toml('[metrics]\nbackends = "jsonl"\n'),
    ),
    Case(
        "section-as-a-value",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[train\] must be a table, got integer 3\.$",
        setup=toml("train = 3\n"),
    ),
    Case(
        "wrong-type-in-an-array-of-tables",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[data\.phases\[0\]\] until_sample: expected an integer, got string '10'\.$",
        setup=toml(
            '[data]\nname = "mixture"\n[[data.sources]]\nname = "synthetic"\n'
            '[[data.phases]]\nuntil_sample = "10"\nweights = [1.0]\n'
        ),
    ),
    Case(
        "wrong-type-of-a-component-option",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[metrics\.jsonl\] filename: expected a string, got integer 1\.$",
        setup=toml('[metrics]\nbackends = ["jsonl"]\n[metrics.jsonl]\nfilename = 1\n'),
    ),
    # -- unknown names -----------------------------------------------------------------------------
    Case(
        "unknown-section",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: \[modle\]: unknown section\. Did you mean 'model'\?",
        setup=toml("[modle]\nn_heads = 8\n"),
    ),
    Case(
        "unknown-key",
        (*VALIDATE, "--model.n_head=8"),
        2,
        r"forge: error: \[model\] n_head: unknown key for model family 'llama'\. Did you mean 'n_heads'\?",
    ),
    Case(
        "unknown-component-option",
        (*TRAIN, "--optimizer.momentum=0.9"),
        2,
        r"forge: error: \[optimizer\] momentum: unknown key for optimizer 'adamw'\.",
    ),
    # -- files that are not configs ------------------------------------------------------------------
    Case(
        "config-not-toml",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: config file '.*run\.toml' is not valid TOML: ",
        setup=toml("this is not toml\n"),
    ),
    Case(
        "config-not-utf8",
        (*TRAIN, "{root}/run.toml"),
        2,
        r"forge: error: config file '.*run\.toml' is not valid TOML: it is not UTF-8 text",
        setup=write_bytes(b"\xff\xfe[model]\n"),
        check=nothing_written,
    ),
    Case(
        "config-nested-arrays-too-deep",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: config file '.*run\.toml' is not a usable config: its arrays or inline tables are nested too "
        r"deeply to read\.",
        setup=toml(deeply_nested_toml("array")),
    ),
    Case(
        "config-nested-inline-tables-too-deep",
        (*TRAIN, "{root}/run.toml"),
        2,
        r"forge: error: config file '.*run\.toml' is not a usable config: its arrays or inline tables are nested too "
        r"deeply to read\.",
        setup=toml(deeply_nested_toml("table")),
        check=nothing_written,
    ),
    Case(
        "run-config-toml-nested-too-deep",
        ("train", "{tiny}", "--train.max_steps=6", "--train.output_dir={run}"),
        2,
        r"forge: error: cannot resume the run in '.*/run': config file '.*/run/config\.toml' is not a usable "
        r"config: its arrays or inline tables are nested too deeply to read\.",
        setup=lambda ws: (ws.run / "config.toml").write_text(deeply_nested_toml("array")),
        needs_run=True,
    ),
    Case(
        "config-is-a-directory",
        (*VALIDATE, "{root}/run.toml"),
        2,
        r"forge: error: config file '.*run\.toml' cannot be read: Is a directory\.$",
        setup=make_directory,
    ),
    Case(
        "config-missing",
        (*TRAIN, "{root}/missing.toml"),
        2,
        r"forge: error: config file '.*missing\.toml' does not exist\.$",
    ),
    Case(
        "config-empty-is-the-defaults",
        (*VALIDATE, "{root}/run.toml"),
        0,
        "",
        setup=toml(""),
        check=the_estimate_is_printed,
    ),
    # -- components of plugins that are blocked or not loaded ----------------------------------------
    Case(
        "blocked-plugin-component-cli",
        ("--block-plugin", "moe", *VALIDATE, "--model.ffn.name=moe"),
        2,
        r"forge: error: \[model\.ffn\] name = 'moe': feed-forward layer 'moe' is provided by plugin 'moe' "
        r"\(forge-moe [^)]+\), which is installed but disabled: blocked by FORGE_LM_BLOCK_PLUGINS or --block-plugin\.",
    ),
    Case(
        "blocked-plugin-component-env",
        (*TRAIN, "--optimizer.name=muon"),
        2,
        r"forge: error: \[optimizer\] name = 'muon': optimizer 'muon' is provided by plugin 'muon' "
        r"\(forge-optim-muon [^)]+\), which is installed but disabled: blocked by FORGE_LM_BLOCK_PLUGINS",
        setup=env(FORGE_LM_BLOCK_PLUGINS="muon"),
        check=nothing_written,
    ),
    Case(
        "autoload-off-plugin-component",
        ("--no-plugin-autoload", *VALIDATE, '--metrics.backends=["wandb"]'),
        2,
        r"forge: error: \[metrics\] backends: metrics backend 'wandb' is provided by plugin 'wandb' \(forge-wandb "
        r"[^)]+\), which is installed but disabled: plugin autoloading is off \(FORGE_LM_DISABLE_PLUGIN_AUTOLOAD or "
        r"--no-plugin-autoload\)\.",
    ),
    Case(
        "allowlist-plugin-component",
        ("--plugins", "wandb", *VALIDATE, "--model.ffn.name=moe"),
        2,
        r"forge: error: \[model\.ffn\] name = 'moe': feed-forward layer 'moe' is provided by plugin 'moe' "
        r"\(forge-moe [^)]+\), which is installed but disabled: not in the plugin allowlist \(FORGE_LM_PLUGINS or "
        r"--plugins\)\.",
    ),
    # -- shapes that cannot be built -------------------------------------------------------------------
    Case(
        "n-heads-not-dividing-dim",
        (*TRAIN, "--model.n_heads=3"),
        2,
        r"forge: error: \[model\] n_heads: dim \(32\) must be divisible by n_heads \(3\)\.$",
    ),
    Case(
        "n-kv-heads-not-dividing-n-heads",
        (*VALIDATE, "--model.n_kv_heads=3"),
        2,
        r"forge: error: \[model\] n_kv_heads: n_heads \(4\) must be divisible by n_kv_heads \(3\)\.$",
    ),
    Case(
        "odd-head-dim",
        (*VALIDATE, "--model.dim=256", "--model.n_heads=256"),
        2,
        r"forge: error: \[model\] n_heads: dim / n_heads = 1 must be even for RoPE\.$",
    ),
    Case(
        "seq-len-over-max-seq-len",
        (*TRAIN, "--train.seq_len=128"),
        2,
        r"forge: error: \[train\] seq_len: 128 exceeds \[model\] max_seq_len \(64\)",
    ),
    Case("zero-dim", (*VALIDATE, "--model.dim=0"), 2, r"forge: error: \[model\] dim: must be > 0, got 0\.$"),
    Case(
        "negative-batch",
        (*TRAIN, "--train.batch_size=-1"),
        2,
        r"forge: error: \[train\] batch_size: must be > 0, got -1\.$",
    ),
    Case(
        "eval-steps-zero",
        (*TRAIN, "--eval.interval=1", "--eval.steps=0"),
        2,
        r"forge: error: \[eval\] steps: must be > 0, got 0\.$",
    ),
    Case(
        "vocab-smaller-than-the-tokenizer-validate",
        (*VALIDATE, "--model.vocab_size=10"),
        2,
        r"forge: error: \[model\] vocab_size: 10 is smaller than the tokenizer's vocabulary \(257\)",
    ),
    Case(
        "tp-not-dividing-the-heads-validate",
        (*VALIDATE, "--distributed.tp=3"),
        2,
        r"forge: error: \[distributed\] tp = 3 must divide \[model\] n_heads = 4",
    ),
    Case(
        "pipeline-with-tied-embeddings-validate",
        (*VALIDATE, "--distributed.pp=2", "--train.grad_accum_steps=2"),
        2,
        r"forge: error: \[distributed\] pipeline stages cannot share one embedding matrix",
    ),
    Case(
        "adamw-betas-of-one",
        (*VALIDATE, "--optimizer.betas=[1.0, 1.0]"),
        2,
        r"forge: error: \[optimizer\] betas: must be \[beta1, beta2\] with both in \[0, 1\), got \[1\.0, 1\.0\]",
    ),
    Case(
        "jsonl-file-out-of-the-run",
        (*VALIDATE, "--metrics.jsonl.filename=../escape.jsonl"),
        2,
        r"forge: error: \[metrics\.jsonl\] filename: must be a file name inside the run directory",
    ),
    Case(
        "jsonl-file-absolute",
        (*VALIDATE, "--metrics.jsonl.filename=/tmp/escape.jsonl"),
        2,
        r"forge: error: \[metrics\.jsonl\] filename: must be a file name inside the run directory",
    ),
    Case(
        "shard-metadata-vocab-size-a-string",
        (*TRAIN, *SHARDS),
        2,
        r"forge: error: metadata file '.*a\.json' states vocab_size = \"257\", which is not a vocabulary size",
        setup=shard_with_metadata('{"vocab_size": "257"}'),
        check=nothing_written,
    ),
    Case(
        "shard-metadata-negative-count",
        (*TRAIN, *SHARDS),
        2,
        r"forge: error: metadata file '.*a\.json' states num_tokens = -1, which is not a count of tokens",
        setup=shard_with_metadata('{"num_tokens": -1}'),
        check=nothing_written,
    ),
    Case(
        "dp-shard-zero",
        (*VALIDATE, "--distributed.dp_shard=0"),
        2,
        r"forge: error: \[distributed\] dp_shard: must be -1 \(the rest\) or at least 1, got 0\.$",
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)
