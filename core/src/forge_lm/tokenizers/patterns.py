"""Refuse a ``tokenizer.json`` whose regular expressions backtrack catastrophically.

A tokenizer's pre-tokenizer ``Split`` (and a normaliser's ``Replace``) runs a regular
expression (Oniguruma, a backtracking engine) over every text it encodes. A pattern that
repeats something already repeated, like ``(a+)+$``, can try exponentially many ways to match
a run of ``a`` before it fails: encoding one such line of a corpus takes seconds to forever,
and Oniguruma's own retry limit, where it is reached, ends the process with a Rust panic.

The patterns are vetted when the file is read, before anything is encoded. Why vetting and
not a timed probe (encoding adversarial strings in a child process with a time limit): a
probe finds only what its strings happen to trigger, which depends on the pattern (``(a+)+$``
needs a long run of ``a`` then something else), and it costs a process start at every build of
the tokenizer; the rule here is deterministic, instant, and the one regex linters use: no
unbounded repetition (``*``, ``+``, ``{n,}``) of a group that itself holds a repetition. The
patterns of the common tokenizer families (GPT-2's, Llama 3's, Qwen's, DeepSeek's) hold none.
A pattern that passes and still exceeds the engine's retry limit on some text is reported by
:class:`forge_lm.tokenizers.hf.HfTokenizer` with that text's beginning.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def regex_patterns(tree: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """Every ``{"Regex": pattern}`` of a parsed ``tokenizer.json``, with where it is
    (``pre_tokenizer.pretokenizers[0].pattern``)."""
    if isinstance(tree, dict):
        regex = tree.get("Regex")
        if isinstance(regex, str):
            yield where, regex
        for key, value in tree.items():
            yield from regex_patterns(value, f"{where}.{key}" if where else str(key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from regex_patterns(value, f"{where}[{index}]")


def nested_repetition(pattern: str) -> str | None:
    """The first group of ``pattern`` that is repeated without bound while it holds a
    repetition itself (``(a+)+``), as written; None when there is none.

    A small scanner, not a full parser: escapes and character classes are skipped whole, and
    a group's repetitions are tracked on a stack of open groups."""
    opened: list[tuple[int, bool]] = []  # per open group: where it starts, whether it holds a repetition
    index, length = 0, len(pattern)
    last_group: tuple[int, bool] | None = None  # the group that just closed (what a quantifier after it applies to)
    while index < length:
        char = pattern[index]
        if char == "\\":
            index += 2
            last_group = None
            continue
        if char == "[":
            index = _class_end(pattern, index)
            last_group = None
            continue
        if char == "(":
            opened.append((index, False))
            index += 1
            last_group = None
            continue
        if char == ")" and opened:
            last_group = opened.pop()
            index += 1
            end = index
            repeats, unbounded, index = _quantifier(pattern, index)
            if last_group[1] and unbounded:
                return pattern[last_group[0] : index]
            if (repeats or last_group[1]) and opened:
                opened[-1] = (opened[-1][0], True)
            if index == end:
                continue
            last_group = None
            continue
        repeats, _, after = _quantifier(pattern, index)
        if after != index:
            if repeats and opened:
                opened[-1] = (opened[-1][0], True)
            index = after
            continue
        last_group = None
        index += 1
    return None


def _quantifier(pattern: str, index: int) -> tuple[bool, bool, int]:
    """At ``index``: (whether a quantifier there repeats, whether without bound, the index
    after it and its lazy or possessive mark); ``(False, False, index)`` when there is none."""
    if index >= len(pattern):
        return False, False, index
    char = pattern[index]
    if char in "*+":
        repeats, unbounded, after = True, True, index + 1
    elif char == "?":
        repeats, unbounded, after = False, False, index + 1
    elif char == "{":
        close = pattern.find("}", index)
        counts = pattern[index + 1 : close].split(",") if close > index else []
        if not counts or len(counts) > 2 or not all(part.strip().isdigit() or part.strip() == "" for part in counts):
            return False, False, index  # a literal brace
        if len(counts) == 1:
            top = int(counts[0]) if counts[0].strip() else 0
            repeats, unbounded = top > 1, False
        else:
            unbounded = counts[1].strip() == ""
            repeats = unbounded or int(counts[1]) > 1
        after = close + 1
    else:
        return False, False, index
    if after < len(pattern) and pattern[after] in "?+":  # lazy or possessive: the same repetition
        after += 1
    return repeats, unbounded, after


def _class_end(pattern: str, index: int) -> int:
    """The index after the character class opening at ``index`` (Oniguruma nests classes)."""
    depth, index = 0, index
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if char == "[":
            depth += 1
            if pattern.startswith("[^]", index) or pattern.startswith("[]", index):
                index += 2 if pattern[index + 1] == "]" else 3  # a leading ] is a literal
                continue
        elif char == "]":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return index
