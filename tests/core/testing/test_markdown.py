"""forge_lm.testing.markdown: the README code-block reader the plugins' README tests share."""

from __future__ import annotations

import pytest

from forge_lm.testing.markdown import code_block, code_blocks

TEXT = """# Title

```toml
[a]
x = 1
```

text

```
plain output
```

```toml
[b]
```
"""


def test_blocks_come_in_order_with_their_language():
    assert code_blocks(TEXT) == [("toml", "[a]\nx = 1\n"), ("", "plain output\n"), ("toml", "[b]\n")]


def test_one_block_is_picked_by_language_and_content(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(TEXT)
    assert code_block(path, "toml", "x = 1") == "[a]\nx = 1\n"
    assert code_block(TEXT, "", "output") == "plain output\n"


@pytest.mark.parametrize(("language", "containing", "count"), [("toml", "[", 2), ("toml", "nowhere", 0)])
def test_none_or_several_matches_are_an_error(language, containing, count):
    with pytest.raises(ValueError, match=f"^{count} "):
        code_block(TEXT, language, containing)


def test_an_unclosed_block_is_an_error():
    with pytest.raises(ValueError, match="not closed"):
        code_blocks("```python\nprint()\n")
