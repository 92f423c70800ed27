"""Issue 36: importing transformers in Forge's environment printed torchao's "Failed to load
..._C_mxfp8..." lines and torch's pytree deprecation notices (torchao comes with forge-float8).
Forge drops exactly those records, in any process that imports it."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from forge_lm._import_noise import quiet_known_import_noise


def _record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)


def test_exactly_the_known_lines_are_dropped_and_other_warnings_pass():
    quiet_known_import_noise()
    quiet_known_import_noise()  # twice: one filter per logger
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert len(torchao.filters) == 1
    assert not torchao.filters[0].filter(
        _record("torchao", "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: ...")
    )
    assert not pytree.filters[0].filter(
        _record("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively supported")
    )
    assert torchao.filters[0].filter(_record("torchao", "Failed to quantize layer 3"))  # not the import noise
    assert torchao.filters[0].filter(_record("torchao", "Skipping import of cpp extensions due to ..."))


def test_importing_transformers_after_forge_prints_nothing():
    pytest.importorskip("transformers")
    # forge_lm imports no logging itself (listing plugins stays cheap): the filters go in when torch is imported.
    code = (
        "import sys\nimport forge_lm\nassert 'logging' not in sys.modules, 'forge_lm imported logging'\n"
        "from transformers import LlamaForCausalLM\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
