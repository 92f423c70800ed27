"""Reading a README's fenced code blocks, for tests that hold a README to what the code does.

A plugin's README shows config snippets, commands and output; a test that takes them from the
README itself (not from a copy in the test) fails when the two drift apart.
"""

from __future__ import annotations

from pathlib import Path


def code_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced code block of the Markdown ``text``, in order: ``(language, contents)``;
    the language is ``''`` for a fence without one."""
    found, language, lines = [], None, []
    for line in text.splitlines(keepends=True):
        if not line.startswith("```"):
            lines.append(line)
        elif language is None:
            language, lines = line[3:].strip(), []
        else:
            found.append((language, "".join(lines)))
            language = None
    if language is not None:
        raise ValueError(f"a ```{language} code block is not closed")
    return found


def code_block(source: str | Path, language: str, containing: str) -> str:
    """The one code block of ``language`` in ``source`` (Markdown text, or a file) that holds
    ``containing``; an error when there is none or more than one."""
    text = source.read_text(encoding="utf-8") if isinstance(source, Path) else source
    matches = [body for lang, body in code_blocks(text) if lang == language and containing in body]
    if len(matches) != 1:
        raise ValueError(f"{len(matches)} ```{language} code blocks hold {containing!r}; expected exactly one")
    return matches[0]
