"""``forge train-tokenizer``: a byte-level BPE that round-trips any text, loads as the 'hf'
tokenizer and drives ``forge prepare-data``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from forge_lm.cli._main import main
from forge_lm.config import structure_options
from forge_lm.errors import ForgeError
from forge_lm.tokenizers import training
from forge_lm.tokenizers.training import END_OF_TEXT, MIN_VOCAB_SIZE, PADDING, train_tokenizer

VOCAB_SIZE = 600
REPO = Path(__file__).resolve().parents[3]

# Written by the test, so the corpus holds text beyond ASCII: accents, CJK, emoji, symbols.
NON_ASCII = "naïve café 東京 🙂 — “curly quotes”, ½ · Ünïcödé façade 東京タワー 🙂🙂\n" * 20

# None of these strings is in the corpus: byte-level BPE must still round-trip them exactly.
UNSEEN = [
    "Zürich, 北京 and Ελλάδα 🙃🚀👩‍👩‍👧 (a family: emoji joined by zero-width joiners)",
    "e\u0301 vs \u00e9: combining accent and precomposed letter stay distinct",
    "\x00\x01\x7f control bytes\r\nWindows line ends\r\n",
    "   leading and trailing spaces   ",
    "\t\ttabs\n\n\nand blank lines\n",
    "".join(chr(code) for code in range(0x20, 0xD000, 97)),  # a spread of code points below the surrogates
    "",
]


def corpus_files(folder: Path) -> dict[str, str]:
    """Forge's own docs, two stdlib source files and the non-ASCII text, as files of ``folder``."""
    folder.mkdir()
    stdlib = Path(json.__file__).parent
    sources = [*sorted((REPO / "docs").glob("*.md")), stdlib / "decoder.py", stdlib / "encoder.py"]
    # .txt names for the Python files: a directory input takes only text suffixes (.txt, .text, .md).
    texts = {f"{source.stem}.{source.suffix[1:]}.txt": source.read_text(encoding="utf-8") for source in sources}
    texts["unicode.txt"] = NON_ASCII
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8")
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("train") / "corpus"
    return folder, corpus_files(folder)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> training.TrainedTokenizer:
    folder, _ = corpus
    return train_tokenizer([str(folder)], tmp_path_factory.mktemp("tok"), vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def reference(trained) -> Tokenizer:
    return Tokenizer.from_file(str(trained.path))


def train_tokenizer_cli(*args: str) -> int:
    return main(["train-tokenizer", *args])


def build_hf(manager, path: Path):
    component = manager.registry.resolve("tokenizers", "hf")
    return component.build(structure_options(manager.registry, component, {"path": str(path)}, "tokenizer"))


def test_training_text_round_trips_exactly(corpus, trained, reference):
    _, texts = corpus
    assert trained.documents == len(texts)  # every file of the corpus was trained on
    for name, text in texts.items():
        ids = reference.encode(text, add_special_tokens=False).ids
        assert reference.decode(ids) == text, name


@pytest.mark.parametrize("text", UNSEEN)
def test_unseen_text_round_trips_exactly_through_the_hf_component(manager, trained, reference, text):
    tokenizer = build_hf(manager, trained.path)

    ids = tokenizer.encode(text)

    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text


def test_every_byte_has_its_own_token_so_nothing_is_unknown(reference):
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = reference.get_vocab()

    assert len(ByteLevel.alphabet()) == 256
    assert all(symbol in vocab for symbol in ByteLevel.alphabet())


def test_the_vocabulary_has_the_size_asked(manager, trained, reference):
    assert trained.vocab_size == VOCAB_SIZE
    assert trained.reached_requested_size
    assert reference.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert max(reference.get_vocab(with_added_tokens=True).values()) == VOCAB_SIZE - 1
    assert build_hf(manager, trained.path).vocab_size == VOCAB_SIZE


def test_special_tokens_sit_at_ids_0_and_1_and_hf_ends_documents_with_endoftext(manager, trained, reference):
    tokenizer = build_hf(manager, trained.path)

    assert trained.special_ids == {END_OF_TEXT: 0, PADDING: 1}
    assert reference.token_to_id(END_OF_TEXT) == 0
    assert reference.token_to_id(PADDING) == 1
    assert tokenizer.eos_id == 0
    assert tokenizer.eos_token == END_OF_TEXT


def test_special_ids_never_come_from_ordinary_text(corpus, reference):
    _, texts = corpus
    for text in [*texts.values(), *UNSEEN, "<|end of text|> <| pad |> <endoftext> |>"]:
        assert not {0, 1} & set(reference.encode(text, add_special_tokens=False).ids)


def test_the_literal_special_string_encodes_as_the_special_token(manager, trained):
    # Documented behaviour of tokenizers' added special tokens: the literal string is matched.
    tokenizer = build_hf(manager, trained.path)

    ids = tokenizer.encode(f"one{END_OF_TEXT}two")

    assert ids == [*tokenizer.encode("one"), 0, *tokenizer.encode("two")]
    assert tokenizer.decode(ids) == "onetwo"  # the hf component drops special tokens when decoding


def test_merges_were_learned_the_training_text_takes_fewer_tokens_than_bytes(corpus, reference):
    _, texts = corpus
    num_bytes = sum(len(text.encode("utf-8")) for text in texts.values())
    num_tokens = sum(len(reference.encode(text, add_special_tokens=False).ids) for text in texts.values())

    assert num_tokens < 0.6 * num_bytes  # about 0.42 here; a byte tokenizer would be 1.0


def test_the_hf_component_gives_the_ids_of_tokenizers_itself(manager, corpus, trained, reference):
    _, texts = corpus
    tokenizer = build_hf(manager, trained.path)

    for text in texts.values():
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_the_same_inputs_give_the_same_file(corpus, trained, tmp_path):
    folder, _ = corpus

    again = train_tokenizer([str(folder)], tmp_path / "again", vocab_size=VOCAB_SIZE)

    assert again.path.read_bytes() == trained.path.read_bytes()


def test_a_corpus_too_small_for_the_vocabulary_stops_short_and_says_so(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("ab ab ab cd cd\n")

    assert train_tokenizer_cli(str(tmp_path / "tiny.txt"), "--vocab-size", "1000", "-o", str(tmp_path / "out")) == 0

    reached = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert MIN_VOCAB_SIZE < reached < 1000  # tokenizers stops when no pair is frequent enough
    assert f"BPE of {reached} tokens (not the 1000 asked: no more pairs occur at least 2" in capsys.readouterr().out


def test_prepare_data_with_the_trained_tokenizer_writes_shards_that_decode_to_the_input(corpus, tmp_path, capsys):
    folder, texts = corpus
    assert train_tokenizer_cli(str(folder), "--vocab-size", str(VOCAB_SIZE), "--output", str(tmp_path / "tok")) == 0
    use = capsys.readouterr().out.split("Use it with: ")[1].strip()
    assert use == f"--tokenizer.name=hf --tokenizer.path={tmp_path / 'tok' / 'tokenizer.json'}"

    # prepare-data with the options exactly as the summary printed them.
    prepare = ["prepare-data", str(folder), "-o", str(tmp_path / "shards"), *shlex.split(use), "--no-plugin-autoload"]
    assert main(prepare) == 0

    metadata = json.loads((tmp_path / "shards" / "shard_00000.json").read_text())
    assert (metadata["eos_id"], metadata["vocab_size"], metadata["tokenizer"]) == (0, VOCAB_SIZE, "hf")
    stream = np.fromfile(tmp_path / "shards" / "shard_00000.bin", dtype=metadata["dtype"]).tolist()
    assert len(stream) == metadata["num_tokens"]
    documents, start = [], 0
    for end in (i for i, token in enumerate(stream) if token == 0):  # each document ends with eos (id 0)
        documents.append(stream[start:end])
        start = end + 1
    assert start == len(stream)
    reference = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert [reference.decode(ids) for ids in documents] == [texts[name] for name in sorted(texts)]


def test_jsonl_input_trains_on_the_text_field(tmp_path, capsys):
    rows = [{"body": f"row {i}: the fox jumps over the lazy dog, café 東京", "id": i} for i in range(30)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")

    code = train_tokenizer_cli(
        str(path), "--format", "jsonl", "--text-field", "body", "--vocab-size", "300", "-o", str(tmp_path / "out")
    )

    assert code == 0
    assert "on 30 document(s)" in capsys.readouterr().out
    reference = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert "Ġfox" in reference.get_vocab()  # learned from the body field (Ġ is the byte-level space)
    assert '"body"' not in reference.get_vocab()  # the JSON around it was not trained on
    assert reference.decode(reference.encode(rows[3]["body"]).ids) == rows[3]["body"]


def test_training_text_containing_a_special_string_is_noted(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(f"first document{END_OF_TEXT}second document{END_OF_TEXT}\n")

    assert train_tokenizer_cli(str(tmp_path / "a.txt"), "--vocab-size", "300", "-o", str(tmp_path / "out")) == 0

    assert f"the training text contains the string '{END_OF_TEXT}' 2 time(s)" in capsys.readouterr().err


def test_a_vocab_size_below_bytes_and_specials_is_refused(tmp_path, corpus, capsys):
    folder, _ = corpus

    assert train_tokenizer_cli(str(folder), "--vocab-size", "257", "-o", str(tmp_path / "out")) == 2

    assert "--vocab-size must be at least 258 (256 byte tokens + 2 special tokens), got 257" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_min_frequency_below_one_is_refused(tmp_path, corpus, capsys):
    folder, _ = corpus

    assert train_tokenizer_cli(str(folder), "--vocab-size", "300", "--min-frequency", "0", "-o", str(tmp_path)) == 2

    assert "--min-frequency must be at least 1, got 0" in capsys.readouterr().err


def test_a_missing_input_is_named(tmp_path, capsys):
    assert train_tokenizer_cli(str(tmp_path / "nope.txt"), "--vocab-size", "300", "-o", str(tmp_path / "out")) == 2

    assert f"forge: error: input '{tmp_path / 'nope.txt'}' does not exist" in capsys.readouterr().err


def test_a_binary_file_is_named_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "good.txt").write_text("plain text\n")
    (tmp_path / "blob.txt").write_bytes(b"text, then \xff\xfe\x00\x89PNG")

    code = train_tokenizer_cli(
        str(tmp_path / "good.txt"), str(tmp_path / "blob.txt"), "--vocab-size", "300", "-o", str(tmp_path / "out")
    )

    assert code == 2
    assert f"forge: error: {tmp_path / 'blob.txt'} is not UTF-8 text (byte 11)" in capsys.readouterr().err
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_an_unreadable_file_is_named(tmp_path, monkeypatch, capsys):
    # Simulated, since the tests may run as root, for whom file permissions do not apply.
    locked = tmp_path / "locked.txt"
    locked.write_text("secret\n")
    read_bytes = Path.read_bytes

    def refuse(path: Path) -> bytes:
        if path == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", refuse)

    assert train_tokenizer_cli(str(locked), "--vocab-size", "300", "-o", str(tmp_path / "out")) == 2

    assert f"forge: error: cannot read '{locked}': Permission denied." in capsys.readouterr().err


def test_a_read_error_without_a_file_name_still_names_the_file(tmp_path, monkeypatch, capsys):
    # As /proc/self/mem: opening works, the read fails with an I/O error that carries no file name.
    broken = tmp_path / "broken.txt"
    broken.write_text("text\n")
    read_bytes = Path.read_bytes

    def fail(path: Path) -> bytes:
        if path == broken:
            raise OSError(5, "Input/output error")
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", fail)

    assert train_tokenizer_cli(str(broken), "--vocab-size", "300", "-o", str(tmp_path / "out")) == 2

    assert f"forge: error: cannot read '{broken}': Input/output error." in capsys.readouterr().err


def test_an_output_folder_that_cannot_be_created_fails_before_training(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text("the fox and the dog and the fox\n")
    (tmp_path / "file").write_text("not a folder\n")
    trained = []
    monkeypatch.setattr(training, "new_tokenizer", lambda modules: trained.append(modules))

    out = tmp_path / "file" / "out"
    assert train_tokenizer_cli(str(tmp_path / "a.txt"), "--vocab-size", "300", "-o", str(out)) == 2

    assert f"forge: error: --output '{out}' cannot be created: '{tmp_path / 'file'}' is not a directory" in (
        capsys.readouterr().err
    )
    assert trained == []  # refused before any training time was spent
    assert (tmp_path / "file").read_text() == "not a folder\n"


def test_inputs_without_text_are_refused(tmp_path, capsys):
    (tmp_path / "blank.txt").write_text(" \n\n")

    assert train_tokenizer_cli(str(tmp_path / "blank.txt"), "--vocab-size", "300", "-o", str(tmp_path / "out")) == 2

    assert "hold no text; nothing was written" in capsys.readouterr().err
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_an_existing_tokenizer_json_is_replaced_only_with_force(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("the fox and the dog and the fox\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "shard_00000.bin").write_bytes(b"other files in the directory are left alone")
    args = [str(tmp_path / "a.txt"), "--vocab-size", "300", "-o", str(out)]

    assert train_tokenizer_cli(*args) == 2
    assert "tokenizer.json' already exists; pass --force to replace it" in capsys.readouterr().err
    assert (out / "tokenizer.json").read_text() == "{}"

    assert train_tokenizer_cli(*args, "--force") == 0
    assert Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(END_OF_TEXT) == 0
    assert sorted(p.name for p in out.iterdir()) == ["shard_00000.bin", "tokenizer.json"]  # no partial file left


def test_an_output_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text\n")

    assert train_tokenizer_cli(str(tmp_path / "a.txt"), "--vocab-size", "300", "-o", str(tmp_path / "a.txt")) == 2

    assert "is a file; give a directory" in capsys.readouterr().err


def test_a_stale_tokenizer_config_beside_it_makes_the_summary_name_the_eos_token(tmp_path, capsys):
    # The hf component prefers a tokenizer_config.json's eos_token; the printed options must still be right.
    (tmp_path / "a.txt").write_text("text for the tokenizer\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer_config.json").write_text(json.dumps({"eos_token": PADDING}))

    assert train_tokenizer_cli(str(tmp_path / "a.txt"), "--vocab-size", "300", "-o", str(tmp_path / "out")) == 0

    assert f"--tokenizer.eos_token={shlex.quote(END_OF_TEXT)}" in capsys.readouterr().out


def test_the_library_refuses_bad_settings_before_reading_anything(tmp_path):
    with pytest.raises(ForgeError, match="unknown input format 'csv'"):
        train_tokenizer([str(tmp_path / "never-read")], tmp_path, vocab_size=300, format="csv")


def test_the_command_is_listed_with_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["train-tokenizer", "--help"])
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--vocab-size", "--output", "--min-frequency", "--format", "--force"))
    assert f"at least {MIN_VOCAB_SIZE}:" in " ".join(out.split())  # the help's number is the one the code enforces
