"""``forge export-hf`` writes the run's tokenizer in Hugging Face form: ``AutoTokenizer`` encodes
text to Forge's ids and decodes them back to the same text, so the exported model gives the
Forge model's log-likelihoods on raw text (Llama, and Mixtral through forge-moe)."""

from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forge_lm.cli._main import main
from forge_lm.config import load_config
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.tokenizers.byte_level import ByteTokenizer
from forge_lm.tokenizers.hf import build_hf_tokenizer
from forge_lm.tokenizers.hf_export import save_hf_tokenizer
from forge_lm.train import train
from forge_lm.train.inference import load_for_inference

transformers = pytest.importorskip("transformers")  # a development dependency: the independent reference

REPO = Path(__file__).resolve().parents[3]
TEXTS = [
    "plain ASCII: def f(x): return x + 1",
    "UTF-8 over several bytes: café, naïve, Zürich, 日本語, Ελληνικά, עברית",
    "emoji: 😀 🎉 👍🏽 👨‍👩‍👧 (a joined family)",
    "lines\nand CRLF\r\nand\ttabs\x0b\x0c and NUL\x00 and DEL\x7f",
    "  leading and trailing spaces  ",
    " , . ! ? 's n't",  # what a tokenizer's clean-up of spaces would change
    "<|pad|> <s> </s> [CLS]",
    "",
]
TINY = (
    *TINY_MODEL,
    "--model.init_std=0.1",
    "--train.batch_size=2",
    "--train.seq_len=32",
    "--train.max_steps=2",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    "--data.name=python_stdlib",
)


def auto_tokenizer(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(directory)


# -- the bytes tokenizer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bytes_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bytes-tokenizer")
    written = save_hf_tokenizer(ByteTokenizer(), out, 64)
    assert written == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_bytes_tokenizer_encodes_to_forges_ids_and_decodes_back(bytes_dir, text):
    hf, forge = auto_tokenizer(bytes_dir), ByteTokenizer()
    assert hf.encode(text, add_special_tokens=False) == forge.encode(text)
    assert hf.encode(text) == forge.encode(text)  # nothing added by default either: no BOS
    assert hf.decode(forge.encode(text)) == text


def test_bytes_tokenizer_decodes_any_byte_sequence_as_forge_does(bytes_dir):
    hf, forge = auto_tokenizer(bytes_dir), ByteTokenizer()
    rng = random.Random(0)
    for _ in range(500):  # mostly not UTF-8: what a model may generate
        ids = [rng.randrange(257) for _ in range(rng.randrange(1, 16))]
        assert hf.decode(ids, skip_special_tokens=True) == forge.decode(ids), ids


def test_bytes_tokenizer_names_the_end_of_text_id_and_no_beginning(bytes_dir):
    hf = auto_tokenizer(bytes_dir)
    assert (hf.eos_token, hf.eos_token_id, hf.bos_token_id) == ("<|endoftext|>", 256, None)
    assert hf.pad_token is None  # the bytes tokenizer has no padding id
    assert hf.model_max_length == 64
    assert json.loads((bytes_dir / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False


def test_the_literal_end_of_text_string_is_the_one_text_encoded_differently(bytes_dir):
    # Documented: the Hugging Face form matches its special token in text; Forge encodes the bytes.
    hf = auto_tokenizer(bytes_dir)
    assert hf.encode("a<|endoftext|>b", add_special_tokens=False) == [97, 256, 98]
    assert ByteTokenizer().encode("a<|endoftext|>b") == list(b"a<|endoftext|>b")


# -- the hf tokenizer -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory) -> Path:
    from forge_lm.tokenizers.training import train_tokenizer

    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text("\n".join(TEXTS[:5] * 20) + "\n" + (REPO / "README.md").read_text(encoding="utf-8"))
    return train_tokenizer([str(corpus)], tmp_path_factory.mktemp("tokenizer"), vocab_size=400).path


def test_hf_tokenizer_is_copied_as_it_is_and_names_its_end_of_text_token(trained_tokenizer, tmp_path):
    from forge_lm.default_plugins.options.tokenizers import HfTokenizerOptions

    forge = build_hf_tokenizer(HfTokenizerOptions(path=str(trained_tokenizer)))
    assert save_hf_tokenizer(forge, tmp_path, 128)[0] == "tokenizer.json"
    assert (tmp_path / "tokenizer.json").read_bytes() == trained_tokenizer.read_bytes()
    hf = auto_tokenizer(tmp_path)
    assert (hf.eos_token, hf.eos_token_id, hf.bos_token_id) == (forge.eos_token, forge.eos_id, None)
    # forge train-tokenizer's <|pad|> (id 1) is the padding token transformers pads batches with
    assert (hf.pad_token, hf.pad_token_id) == ("<|pad|>", 1)
    padded = hf(["a", "a longer text"], padding=True)["input_ids"]
    assert padded[0][-1] == 1
    assert len(padded[0]) == len(padded[1])
    for text in TEXTS:
        ids = forge.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        # Both drop special tokens when decoding (the trained tokenizer's <|pad|> is one).
        assert hf.decode(ids, skip_special_tokens=True) == forge.decode(ids) == text.replace("<|pad|>", "")


def test_a_tokenizer_without_a_known_hugging_face_form_writes_nothing(tmp_path):
    class Letters:
        vocab_size, eos_id = 27, 26

    assert save_hf_tokenizer(Letters(), tmp_path / "out", 64) == []
    assert not (tmp_path / "out").exists()


# -- forge export-hf ------------------------------------------------------------------------------


def trained(tmp_path: Path, *overrides: str, manager: PluginManager | None = None) -> Path:
    manager = manager or PluginManager(PluginSettings(autoload=False))
    run_dir = tmp_path / "run"
    train(load_config(None, [*TINY, *overrides, f"--train.output_dir={run_dir}"], manager.registry), manager)
    return run_dir


def per_token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return F.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def assert_same_loglikelihoods(run_dir: Path, hf_dir: Path, model_class, manager: PluginManager) -> None:
    """The exported model and tokenizer score raw text as the Forge model and tokenizer do."""
    model, _, tokenizer = load_for_inference(run_dir, manager)
    hf_model, hf_tokenizer = model_class.from_pretrained(hf_dir).eval(), auto_tokenizer(hf_dir)
    for text in TEXTS[:5]:
        ids = tokenizer.encode(text)[:63]
        hf_ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"][:63]
        assert hf_ids == ids
        ids = [tokenizer.eos_id, *ids]  # a document follows an end of text
        with torch.no_grad():
            ours = per_token_logprobs(model(torch.tensor([ids])), ids)
            theirs = per_token_logprobs(hf_model(torch.tensor([ids])).logits, ids)
        torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bytes", "hf"])
def test_export_hf_writes_the_tokenizer_beside_a_llama(kind, trained_tokenizer, tmp_path, capsys):
    choice = (
        ["--tokenizer.name=bytes"]
        if kind == "bytes"
        else ["--tokenizer.name=hf", f"--tokenizer.path={trained_tokenizer}"]
    )
    run_dir = trained(tmp_path, *choice)
    capsys.readouterr()

    assert main(["--no-plugin-autoload", "export-hf", str(run_dir), str(tmp_path / "hf")]) == 0

    assert capsys.readouterr().out == f"wrote a Hugging Face LlamaForCausalLM and its tokenizer to {tmp_path / 'hf'}\n"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        path.name for path in (tmp_path / "hf").iterdir()
    }
    manager = PluginManager(PluginSettings(autoload=False))
    assert_same_loglikelihoods(run_dir, tmp_path / "hf", transformers.LlamaForCausalLM, manager)


def test_an_export_imports_back_with_the_same_token_ids(tmp_path):
    run_dir = trained(tmp_path)
    assert main(["--no-plugin-autoload", "export-hf", str(run_dir), str(tmp_path / "hf")]) == 0
    imported = tmp_path / "imported"
    assert main(["--no-plugin-autoload", "import-hf", str(tmp_path / "hf"), f"--train.output_dir={imported}"]) == 0

    _, config, tokenizer = load_for_inference(imported, PluginManager(PluginSettings(autoload=False)))
    assert config.tokenizer.name == "hf"  # the exported tokenizer.json, read by the hf tokenizer
    assert (tokenizer.eos_id, tokenizer.vocab_size) == (256, 257)
    for text in TEXTS:
        assert tokenizer.encode(text) == ByteTokenizer().encode(text)


def test_a_mixtral_export_gets_the_tokenizer_too(tmp_path, capsys):
    pytest.importorskip("forge_moe")
    manager = PluginManager(PluginSettings(autoload=False, allow=("moe",)))
    moe = (str(REPO / "configs" / "moe_debug.toml"), "--model.ffn.n_experts=4")
    run_dir = tmp_path / "run"
    config = load_config(moe[0], [*TINY, moe[1], f"--train.output_dir={run_dir}"], manager.registry)
    train(config, manager)
    capsys.readouterr()

    assert main(["--plugins", "moe", "export-hf", str(run_dir), str(tmp_path / "hf")]) == 0

    assert "MixtralForCausalLM and its tokenizer" in capsys.readouterr().out
    assert_same_loglikelihoods(run_dir, tmp_path / "hf", transformers.MixtralForCausalLM, manager)


def install_letters(fake_site) -> None:
    """Plugin ``forge-letters``: tokenizer ``letters``, without a Hugging Face form."""
    fake_site.install(
        "forge-letters",
        textwrap.dedent(
            """
            from forge_lm import hookimpl

            FORGE_LM_PLUGIN_API = ">=1,<2"

            class Letters:
                vocab_size, eos_id = 257, 256

                def encode(self, text):
                    return list(text.encode("utf-8"))

                def decode(self, ids):
                    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

            @hookimpl
            def forge_lm_register_tokenizers(register):
                register("letters", lambda options: Letters(), description="bytes under another name")
            """
        ),
    )


def test_a_plugin_tokenizer_without_a_hugging_face_form_is_named_in_a_warning(fake_site, tmp_path, capsys):
    install_letters(fake_site)
    run_dir = trained(tmp_path, "--tokenizer.name=letters", manager=PluginManager(PluginSettings(allow=("letters",))))
    capsys.readouterr()

    assert main(["--plugins", "letters", "export-hf", str(run_dir), str(tmp_path / "hf")]) == 0

    captured = capsys.readouterr()
    assert captured.out == f"wrote a Hugging Face LlamaForCausalLM to {tmp_path / 'hf'}\n"
    assert captured.err.endswith(
        f"forge: warning: the run's tokenizer 'letters' has no Hugging Face form Forge knows; {tmp_path / 'hf'} "
        "holds no tokenizer\n"
    )
    assert not (tmp_path / "hf" / "tokenizer.json").exists()


def test_export_into_the_folder_of_the_runs_own_tokenizer_keeps_it_and_completes(trained_tokenizer, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    own = hf_dir / "tokenizer.json"  # the run trained with --tokenizer.path=hf/tokenizer.json
    own.write_bytes(trained_tokenizer.read_bytes())
    run_dir = trained(tmp_path, "--tokenizer.name=hf", f"--tokenizer.path={own}")
    capsys.readouterr()

    assert main(["--no-plugin-autoload", "export-hf", str(run_dir), str(hf_dir)]) == 0

    assert capsys.readouterr().out == f"wrote a Hugging Face LlamaForCausalLM and its tokenizer to {hf_dir}\n"
    assert own.read_bytes() == trained_tokenizer.read_bytes()
    names = {path.name for path in hf_dir.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    manager = PluginManager(PluginSettings(autoload=False))
    assert_same_loglikelihoods(run_dir, hf_dir, transformers.LlamaForCausalLM, manager)


def test_an_earlier_export_is_replaced_only_with_force_and_leaves_no_stale_shards(tmp_path, capsys):
    run_dir = trained(tmp_path)
    hf_dir = tmp_path / "hf"
    assert main(["--no-plugin-autoload", "export-hf", str(run_dir), str(hf_dir)]) == 0
    # What an earlier, sharded export (save_pretrained's) leaves beside it, and a file of the user's.
    (hf_dir / "model.safetensors").rename(hf_dir / "model-00001-of-00002.safetensors")
    (hf_dir / "model-00002-of-00002.safetensors").write_bytes(b"an older shard")
    (hf_dir / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (hf_dir / "notes.txt").write_text("mine\n")
    before = {path.name: path.read_bytes() for path in hf_dir.iterdir()}
    capsys.readouterr()

    assert main(["--no-plugin-autoload", "export-hf", str(run_dir), str(hf_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"forge: error: '{hf_dir}' already holds an export (config.json, model-00001-of-00002")
    assert "pass --force" in err
    assert {path.name: path.read_bytes() for path in hf_dir.iterdir()} == before

    assert main(["--no-plugin-autoload", "export-hf", str(run_dir), str(hf_dir), "--force"]) == 0
    names = {path.name for path in hf_dir.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "notes.txt",
    }
    assert (hf_dir / "notes.txt").read_text() == "mine\n"
    manager = PluginManager(PluginSettings(autoload=False))
    assert_same_loglikelihoods(run_dir, hf_dir, transformers.LlamaForCausalLM, manager)


def test_force_removes_the_tokenizer_files_of_an_earlier_export_that_this_one_does_not_write(fake_site, tmp_path):
    hf_dir = tmp_path / "hf"
    assert main(["--no-plugin-autoload", "export-hf", str(trained(tmp_path / "bytes")), str(hf_dir)]) == 0
    install_letters(fake_site)
    run_dir = trained(
        tmp_path / "letters", "--tokenizer.name=letters", manager=PluginManager(PluginSettings(allow=("letters",)))
    )

    assert main(["--plugins", "letters", "export-hf", str(run_dir), str(hf_dir), "--force"]) == 0

    assert {path.name for path in hf_dir.iterdir()} == {"config.json", "model.safetensors"}
