"""An exported Hugging Face directory has the file modes any new file gets (0666 less the umask),
not safetensors' private 0600: the kernel takes the umask off when forge_lm.safe_write creates the
file, and safetensors writes it in place."""

from __future__ import annotations

import os
import stat
import sys

import pytest
import torch

from forge_lm.model.hf import CONFIG_FILE, WEIGHTS_FILE, write_hf

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX file modes")


@pytest.fixture
def umask():
    """``umask(mask)`` sets the process's umask for the test; the previous one comes back after."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_exported_weights_get_the_mode_a_new_file_gets(umask, tmp_path, mask):
    umask(mask)

    out = write_hf(tmp_path / "hf-model", {"model_type": "llama"}, {"weight": torch.zeros(2, 2)})

    assert stat.S_IMODE((out / WEIGHTS_FILE).stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((out / CONFIG_FILE).stat().st_mode) == 0o666 & ~mask
