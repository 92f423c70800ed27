"""Counters for tests of what runs beneath the Python code: the operators that reach torch's
dispatcher, and the graphs torch.compile hands a backend. Imports torch when imported."""

from __future__ import annotations

import collections
from typing import Any

from torch._dynamo.backends.registry import lookup_backend
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every operator overload that reaches the dispatcher while it is active
    (``with OpCounter() as ops: ...; ops.counts[torch.ops.aten.mm.default]``). Under selective
    activation checkpointing an operation whose output was kept is answered from the cache
    above this mode, so in a backward pass only recomputed operations are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[object] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


class CountingBackend:
    """A torch.compile backend that is ``aot_eager`` (AOTAutograd, as inductor uses it, without
    generating kernels), counting the graphs it is handed: one per compiled frame, graph
    break and recompile."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        return lookup_backend("aot_eager")(graph, example_inputs)
