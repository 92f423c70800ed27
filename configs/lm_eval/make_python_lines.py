"""Write python_lines.jsonl: the items of the lm-eval task python_lines.yaml.

Each item is four lines before a line of a Python standard-library module and four choices
for that line, each indented as it is: the real one; the same words in another order; the same
words with the letters inside them shuffled; and the line with half its letters replaced by
random ones. All four have the same length, so no choice wins by being short: a model that
has learnt what Python looks like prefers the real line (the random letters first, which only
letter frequencies give away; the shuffles need more); one that has not scores about 1 in 4.
The items are taken from the modules named below, which every CPython 3.11 or later has, with
a fixed seed: the same Python version gives the same file. Run it from anywhere:

    python configs/lm_eval/make_python_lines.py [--items 500] [--output PATH]

The stdlib is the python_stdlib dataset's text, so a model trained on it has seen these lines:
the task ranks how well a model has learnt Python source, not how it generalises.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sysconfig
from pathlib import Path
from string import ascii_lowercase, ascii_uppercase

SEED = 36
ITEMS = 500
CONTEXT_LINES = 4
MIN_LINE, MAX_LINE = 20, 56  # characters of a choice, indentation included: it fits a context of 64 bytes
OUTPUT = Path(__file__).resolve().parent / "python_lines.jsonl"
MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code", "codecs", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "dis", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext",
    "glob", "gzip", "heapq", "hmac", "html/parser", "imaplib", "inspect", "ipaddress",
    "json/decoder", "json/encoder", "keyword", "linecache", "locale", "logging/__init__",
    "mailbox", "mimetypes", "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pdb",
    "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint", "queue", "quopri",
    "random", "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib",
    "socket", "socketserver", "statistics", "string", "subprocess", "symtable", "tabnanny",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "token", "tokenize", "trace",
    "traceback", "types", "typing", "urllib/parse", "uuid", "warnings", "wave", "weakref",
    "zipfile", "zipimport",
)  # fmt: skip
WORD = re.compile(r"[A-Za-z]{4,}")


def module_lines(stdlib: Path) -> dict[str, list[str]]:
    """Each module's source lines (without line ends); modules this Python lacks are left out."""
    found = {}
    for name in MODULES:
        path = stdlib / f"{name}.py"
        if path.is_file():
            found[name] = path.read_text(encoding="utf-8").splitlines()
    return found


def is_target(line: str) -> bool:
    """A line of code worth guessing: long enough, ASCII, not a comment or a docstring's text."""
    text = line.strip()
    return (
        MIN_LINE <= len(line.rstrip()) <= MAX_LINE
        and text.isascii()
        and not text.startswith(("#", '"', "'"))
        and len(text.split()) >= 3
        and WORD.search(text) is not None
    )


def shuffled_words(text: str, rng: random.Random) -> str | None:
    """The line's words in another order, between the same runs of spaces (the same length)."""
    parts = re.split(r"(\s+)", text)
    words, spaces = parts[0::2], parts[1::2]
    for _ in range(10):
        order = rng.sample(words, len(words))
        if order != words:
            return "".join(word + space for word, space in zip(order, [*spaces, ""], strict=True))
    return None


def swapped_letters(text: str, rng: random.Random) -> str | None:
    """The line with the letters inside each word of four or more letters shuffled (first and
    last kept): the same characters, spelt wrong."""

    def scramble(match: re.Match[str]) -> str:
        word = match.group(0)
        inner = list(word[1:-1])
        rng.shuffle(inner)
        return word[0] + "".join(inner) + word[-1]

    changed = WORD.sub(scramble, text)
    return changed if changed != text else None


def random_letters(text: str, rng: random.Random) -> str | None:
    """Half the letters of the line (chosen at random) replaced by random letters of the same case."""
    letters = [i for i, char in enumerate(text) if char.isalpha()]
    chars = list(text)
    for i in rng.sample(letters, len(letters) // 2):
        chars[i] = rng.choice(ascii_uppercase if chars[i].isupper() else ascii_lowercase)
    changed = "".join(chars)
    return changed if changed != text else None


def make_items(count: int, stdlib: Path) -> list[dict]:
    rng = random.Random(SEED)
    modules = module_lines(stdlib)
    candidates = [
        (name, index)
        for name, lines in sorted(modules.items())
        for index, line in enumerate(lines)
        if index >= CONTEXT_LINES and is_target(line)
    ]
    items, seen = [], set()
    for name, index in rng.sample(candidates, len(candidates)):
        lines = modules[name]
        target = lines[index]
        text = target.strip()
        if text in seen:
            continue
        indent = target[: len(target) - len(target.lstrip())]
        variants = [shuffled_words(text, rng), swapped_letters(text, rng), random_letters(text, rng)]
        if None in variants or len({text, *variants}) < 4:
            continue
        seen.add(text)
        context = "\n".join(lines[index - CONTEXT_LINES : index])
        # Every choice is indented as the real line: the indentation tells none of them apart.
        choices = [indent + choice for choice in (text, *variants)]
        order = rng.sample(range(4), 4)
        items.append(
            {
                "question": f"{context}\n",
                "choices": [choices[i] for i in order],
                "answer": order.index(0),
                "source": f"{name}.py:{index + 1}",
            }
        )
        if len(items) == count:
            return items
    raise SystemExit(f"only {len(items)} items could be made from this Python's standard library")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=ITEMS)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    items = make_items(args.items, Path(sysconfig.get_paths()["stdlib"]))
    args.output.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    print(f"wrote {len(items)} items to {args.output}")


if __name__ == "__main__":
    main()
