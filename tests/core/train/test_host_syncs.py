"""At most one device-to-host transfer per optimizer step that is not logged.

On a GPU, each read of a device tensor as a Python value (``item``, ``tolist``, ``float``,
``int``, ``bool``) waits for every kernel queued before it: the host stops feeding the device.
Here on CPU the reads are counted instead, by wrapping those methods, for the reads made by
Forge's own training code (the data loader checks token ids on the host, before a batch goes to
the device: those reads are not transfers; torch's optimizers keep their step counters on the
host unless ``capturable``).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

import forge_lm
from forge_lm.train import train

FORGE = Path(forge_lm.__file__).parent
HOST_SIDE = (FORGE / "data",)  # host-side code by design (see the module docstring)
# Reads that Forge makes only of CPU tensors, where nothing is transferred: clip_grads reads its
# scale on the CPU alone (an accelerator's norm is never read there; tests/core/distributed/test_grads.py).
CPU_ONLY = {("grads.py", "clip_grads")}


class TransferCounter:
    """Counts reads of tensors as Python values whose caller is Forge's code, per optimizer step."""

    READS = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step = 0
        self.per_step: collections.Counter[int] = collections.Counter()
        self.where: dict[int, list[str]] = collections.defaultdict(list)
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))

    def _counting(self, read):
        counter = self

        def wrapper(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            path = Path(caller.f_code.co_filename)
            cpu_only = (path.name, caller.f_code.co_name) in CPU_ONLY and tensor.device.type == "cpu"
            if path.is_relative_to(FORGE) and not any(path.is_relative_to(d) for d in HOST_SIDE) and not cpu_only:
                counter.per_step[counter.step] += 1
                counter.where[counter.step].append(f"{path.name}:{caller.f_lineno}")
            return read(tensor, *args, **kwargs)

        return wrapper


class _StepCounterPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, counter: TransferCounter) -> None:
        self.counter = counter

    @forge_lm.hookimpl
    def forge_lm_step_end(self, step):
        self.counter.step = step  # reads from here on belong to the next step


def test_a_step_that_is_not_logged_reads_the_device_once(tiny_config, manager, monkeypatch):
    counter = TransferCounter(monkeypatch)
    manager.add_plugin(_StepCounterPlugin(counter), "counter")
    config = tiny_config(
        "--train.grad_accum_steps=4",
        "--train.max_steps=12",
        "--metrics.log_interval=5",
        "--eval.interval=0",
        "--checkpoint.interval=0",
    )
    train(config, manager)
    logged = {1, 5, 10, 12}
    # Reads during step s+1 are counted under s (the counter moves at step_end); the reads of a
    # logged step happen after its step_end, so they count under that step.
    quiet = [s for s in range(1, 11) if s not in logged and s + 1 not in logged]
    assert quiet, "the schedule leaves no step without logging around it"
    for step in quiet:
        assert counter.per_step[step] <= 1, (step, counter.where[step])
    assert all(counter.per_step[step] == 1 for step in quiet)  # the finiteness check: read exactly once
    # The check is a real one: the same count without the optimization would be 4 micro-batches + 2.
    assert max(counter.per_step.values()) < 4 + 2
