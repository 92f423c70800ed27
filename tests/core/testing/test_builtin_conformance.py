"""The core's own components pass the conformance kit that third-party plugins use."""

import tempfile
from pathlib import Path

from forge_lm.components import AttentionSpec
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import parametrize_with_checks
from forge_lm.testing._references import cross_entropy_with_z_loss_by_hand

BUILTINS_ONLY = PluginManager(PluginSettings(autoload=False))


def _byte_level_bpe_json() -> str:
    """A small trained byte-level BPE tokenizer.json for the 'hf' tokenizer's checks.

    Written at collection, when the kit's options are fixed; the folder lasts until the
    interpreter exits (a module global whose finaliser removes it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["Hello, Forge! The fox jumps over the lazy dog."] * 4, trainer)
    path = Path(_HF_DIR.name) / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


_HF_DIR = tempfile.TemporaryDirectory(prefix="forge-conformance-")


@parametrize_with_checks(
    components=[
        ("optimizers", "adamw"),
        ("schedulers", "constant"),
        ("schedulers", "cosine"),
        ("losses", "cross_entropy"),
        ("datasets", "synthetic"),
        ("metrics_backends", "console"),
        ("metrics_backends", "jsonl"),
        ("tokenizers", "bytes"),
        ("metrics_backends", "tensorboard"),
        ("tokenizers", "hf", {"options": {"path": _byte_level_bpe_json()}}),
        ("optimizers", "lion"),
        ("optimizers", "schedule_free_adamw"),
        ("schedulers", "none"),
        ("schedulers", "linear"),
        ("schedulers", "wsd"),
        ("schedulers", "rex"),
        ("losses", "chunked_cross_entropy"),
        ("feed_forwards", "swiglu"),
    ],
    manager=BUILTINS_ONLY,
)
def test_builtin_component_honours_its_contract(check):
    check()


@parametrize_with_checks(
    components=[
        ("optimizers", "schedule_free_adamw", {"options": {"warmup_steps": 5}}),
        ("schedulers", "wsd", {"options": {"cooldown": "cosine", "min_lr_ratio": 0.1}}),
        ("schedulers", "wsd", {"options": {"cooldown": "linear", "decay_fraction": 1.0}}),
        ("losses", "chunked_cross_entropy", {"options": {"chunk_size": 5}}),  # uneven chunks
        (
            "losses",
            "cross_entropy",
            {"options": {"z_loss_weight": 0.01}, "reference": cross_entropy_with_z_loss_by_hand(0.01)},
        ),
        (
            "losses",
            "chunked_cross_entropy",
            {"options": {"chunk_size": 7, "z_loss_weight": 0.01}, "reference": cross_entropy_with_z_loss_by_hand(0.01)},
        ),
    ],
    manager=BUILTINS_ONLY,
)
def test_builtin_component_with_non_default_options_honours_its_contract(check):
    check()


_DATA_DIR = tempfile.TemporaryDirectory(prefix="forge-conformance-data-")


def _dataset_files() -> dict[str, str]:
    """Small corpora for the datasets that read files: a uint16 .bin shard with its metadata,
    and a JSON-lines file. Written at collection, like the tokenizer above."""
    import json

    import numpy as np

    root = Path(_DATA_DIR.name)
    tokens = np.random.default_rng(0).integers(0, 257, size=4000).astype("<u2")  # 256 is eos
    tokens.tofile(root / "tokens.bin")
    metadata = {"dtype": "uint16", "num_tokens": len(tokens), "eos_id": 256, "vocab_size": 257}
    (root / "tokens.json").write_text(json.dumps(metadata))
    words = np.random.default_rng(1).choice(["forge", "plugin", "token", "model", "data", "loss"], size=(200, 12))
    rows = [json.dumps({"text": " ".join(row), "id": index}) for index, row in enumerate(words)]
    (root / "docs.jsonl").write_text("\n".join(rows) + "\n")
    return {"bin": str(root / "tokens.bin"), "jsonl": str(root / "docs.jsonl"), "cache": str(root / "hf-cache")}


def _text_context(**changes):
    from forge_lm.components import DataContext
    from forge_lm.tokenizers.byte_level import ByteTokenizer

    settings = {"seq_len": 64, "vocab_size": 257, "seed": 7, "tokenizer": ByteTokenizer(), **changes}
    return DataContext(**settings, registry=BUILTINS_ONLY.registry)


_FILES = _dataset_files()


@parametrize_with_checks(
    components=[
        ("datasets", "python_stdlib", {"context": _text_context()}),
        ("datasets", "python_stdlib", {"options": {"eval_fraction": 0.2}, "context": _text_context(split="eval")}),
        ("datasets", "memmap", {"options": {"path": _FILES["bin"]}, "context": _text_context(seq_len=16)}),
        (
            "datasets",
            "memmap",
            {"options": {"path": _FILES["bin"], "eval_fraction": 0.1}, "context": _text_context(split="eval")},
        ),
        (
            "datasets",
            "hf_text",
            {
                "options": {"path": _FILES["jsonl"], "format": "jsonl", "cache_dir": _FILES["cache"]},
                "context": _text_context(seq_len=32),
            },
        ),
        (
            "datasets",
            "mixture",
            {
                "options": {
                    "sources": [{"name": "python_stdlib"}, {"name": "synthetic"}],
                    "weights": [3.0, 1.0],
                    "temperature": 2.0,
                    "phases": [{"until_sample": 2, "weights": [0.0, 1.0]}],
                },
                "context": _text_context(),
            },
        ),
    ],
    manager=BUILTINS_ONLY,
)
def test_builtin_dataset_honours_its_contract(check):
    check()


TINY_LLAMA = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64}


@parametrize_with_checks(
    components=[
        ("models", "llama", {"options": TINY_LLAMA}),
        (
            "models",
            "llama",
            {
                "options": {
                    **TINY_LLAMA,
                    "tie_embeddings": False,
                    "qk_norm": True,
                    "attention_backend": "sdpa",
                    "attention": {"name": "sliding_window", "window": 4},
                }
            },
        ),
        ("attentions", "gqa"),
        ("attentions", "gqa", {"spec": AttentionSpec(32, 4, 4, 8, n_layers=2, max_seq_len=64, rope_theta=500.0)}),
        (
            "attentions",
            "gqa",
            {"spec": AttentionSpec(32, 4, 1, 8, n_layers=3, max_seq_len=64, rope_theta=1e4, qk_norm=True)},
        ),
        ("attentions", "sliding_window", {"options": {"window": 4}}),
        ("attentions", "sliding_window", {"options": {"window": 1}}),
    ],
    manager=BUILTINS_ONLY,
)
def test_builtin_model_family_and_attention_honour_their_contracts(check):
    check()
