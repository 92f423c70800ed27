"""Initial weights that do not depend on how the model is laid out over ranks.

Why: under ``torchrun`` the model is built on the meta device (no memory), cut into pipeline
stages and transformed (tensor, expert and data parallelism), and only then given memory,
shard by shard (:func:`materialize`). No rank ever holds the whole model, so the initial values
cannot be drawn in one pass over the whole model from torch's global generator, as one process
could; and DTensor's own random ops follow the layout (and are offset-based on CUDA only). So
every value is defined by the run's seed and the tensor's fully-qualified name alone:

- a random tensor (:meth:`Initializer.normal`) is drawn in chunks of whole rows along its first
  dimension (rows ``[c * R, (c + 1) * R)``, ``R = max(1, CHUNK_ELEMENTS // row size)``, both from
  the global shape), chunk ``c`` from its own CPU generator seeded with a hash of
  ``(seed, name, c)``. A rank draws only the chunks that overlap its part of the tensor and
  copies in the part it holds, so peak memory is one chunk, not one model, and the values are
  those of the one-process model whatever the placements (``Shard``, ``_StridedShard``,
  uneven splits, several mesh dimensions);
- constants (:meth:`~Initializer.ones`, :meth:`~Initializer.zeros`) fill the local part;
- tables computed from the config, such as the RoPE buffers (:meth:`~Initializer.copy`), are
  computed whole and this rank's part copied in.

The one-process build (:func:`initialize`, called by ``build_model``) runs the same rules on
plain tensors, so a 2-rank FSDP2 run, a tensor-parallel run and one process start from the
same weights, bit for bit.

Modules take part through ``init_weights(init)``, see :class:`forge_lm.components.Initializer`
for the contract plugin modules follow. Every parameter and buffer must be set by some rule:
after a model is initialised, :func:`initialize` names any tensor no rule wrote (after
``to_empty`` it would hold garbage).
"""

from __future__ import annotations

import hashlib
import inspect
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from forge_lm.components import InitializesWeights, is_norm_layer
from forge_lm.errors import ForgeError, PluginError

CHUNK_ELEMENTS = 1 << 20
"""Values per random chunk (4 MiB in fp32): part of the definition of the initial weights."""


def _dtensor_class() -> type | None:
    """DTensor, if torch.distributed.tensor was imported (no DTensor can exist otherwise; a
    single-process run never pays for the slow import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank writes into: a DTensor's local shard (a view of its storage)."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def local_indices(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """For each dimension of a DTensor's global shape, the global indices its local shard holds,
    in the local order (None for a plain tensor, which holds everything).

    Sharding acts on each tensor dimension separately, so the indices along dimension ``d`` are
    what the placements that split ``d`` make of ``arange(size[d])``: ``distribute_tensor`` of
    that small vector, with only those placements and without communication
    (``src_data_rank=None``), which applies torch's own rules (uneven chunks, ``_StridedShard``
    from FSDP2 over tensor parallelism, several mesh dimensions on one tensor dimension).
    """
    if not _is_dtensor(tensor):
        return None
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    indices = []
    for dim, size in enumerate(tensor.shape):
        placements = []
        for placement in tensor.placements:
            if placement.is_partial():
                raise ForgeError(f"cannot initialise a tensor with a Partial placement ({tensor.placements}).")
            if isinstance(placement, _StridedShard) and placement.dim % tensor.ndim == dim:
                placements.append(_StridedShard(0, split_factor=placement.split_factor))
            elif isinstance(placement, Shard) and placement.dim % tensor.ndim == dim:
                placements.append(Shard(0))
            else:
                placements.append(Replicate())
        positions = torch.arange(size, device=tensor.device)
        held = distribute_tensor(positions, tensor.device_mesh, placements, src_data_rank=None).to_local()
        indices.append(held.cpu())
    local_shape = tuple(_local(tensor).shape)
    if tuple(len(index) for index in indices) != local_shape:
        raise ForgeError(
            f"the local shard {local_shape} of a DTensor {tuple(tensor.shape)} with placements "
            f"{tensor.placements} is not the part its placements describe."
        )
    return indices


def _seed_of(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _rows_per_chunk(shape: tuple[int, ...]) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, math.prod(shape[1:])))


class Initializer:
    """Sets a model's parameters and buffers, on any layout, to values that depend only on the
    seed and each tensor's fully-qualified name in ``root`` (see the module docstring).

    ``std``: ``[model] init_std``; ``residual_std``: the std of projections that write into the
    residual stream (``init_std / sqrt(2 * n_layers)`` in the transformer). Implements the
    :class:`forge_lm.components.Initializer` contract.
    """

    def __init__(self, root: nn.Module, seed: int, std: float, residual_std: float | None = None) -> None:
        self.seed, self.std = int(seed), float(std)
        self.residual_std = float(std if residual_std is None else residual_std)
        self._names: dict[int, str] = {}  # id(tensor) -> its first name (a tied tensor has two)
        self._tensors: dict[str, torch.Tensor] = {}
        for name, tensor in [
            *root.named_parameters(remove_duplicate=False),
            *root.named_buffers(remove_duplicate=False),
        ]:
            if id(tensor) not in self._names:
                self._names[id(tensor)] = name
                self._tensors[name] = tensor
        self._written: set[int] = set()

    # -- the contract -------------------------------------------------------------------------

    def name_of(self, tensor: torch.Tensor) -> str:
        """The fully-qualified name of ``tensor`` in the model being initialised."""
        name = self._names.get(id(tensor))
        if name is None:
            raise ForgeError(
                f"init: a tensor of shape {tuple(tensor.shape)} is not a parameter or buffer of the module "
                "being initialised; pass the module's own attributes (self.weight), not a copy or .data."
            )
        return name

    @torch.no_grad()
    def normal(self, tensor: torch.Tensor, std: float, mean: float = 0.0) -> None:
        """``normal(mean, std)``, drawn per chunk from generators seeded by (seed, name, chunk)."""
        name = self.name_of(tensor)

        def rows(chunk: int, start: int, stop: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(_seed_of(self.seed, name, chunk))
            shape = (stop - start, *tensor.shape[1:])
            return torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=generator)

        self._fill(tensor, rows)

    @torch.no_grad()
    def constant(self, tensor: torch.Tensor, value: float) -> None:
        self.name_of(tensor)
        _local(tensor).fill_(value)
        self._written.add(id(tensor))

    def ones(self, tensor: torch.Tensor) -> None:
        self.constant(tensor, 1.0)

    def zeros(self, tensor: torch.Tensor) -> None:
        self.constant(tensor, 0.0)

    @torch.no_grad()
    def copy(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """This rank's part of ``values``, a whole tensor of ``tensor``'s global shape (on any
        device): for values computed from the config, such as lookup tables."""
        self.name_of(tensor)
        if tuple(values.shape) != tuple(tensor.shape):
            raise ForgeError(
                f"init.copy: values of shape {tuple(values.shape)} for {self.name_of(tensor)} "
                f"{tuple(tensor.shape)}; give the whole tensor."
            )
        rows = values.reshape(1) if values.ndim == 0 else values
        self._fill(tensor, lambda chunk, start, stop: rows[start:stop])

    def module(self, module: nn.Module) -> None:
        """Initialise ``module`` by its own rule, ``module.init_weights(init)``, or, if it has
        none, by the default one: linear and embedding weights ``normal(0, std)``, biases 0,
        norm scales 1, recursively (a submodule with ``init_weights`` applies its own)."""
        if isinstance(module, InitializesWeights) and callable(module.init_weights):
            _check_signature(module, module.init_weights)
            module.init_weights(self)
            return
        for name, tensor in module.named_parameters(recurse=False):
            if name == "bias":
                self.zeros(tensor)
            elif isinstance(module, nn.Linear | nn.Embedding):
                self.normal(tensor, self.std)
            elif is_norm_layer(module):  # the rule parameter_roles uses too
                self.ones(tensor)
        for child in module.children():
            self.module(child)

    # -- bookkeeping ----------------------------------------------------------------------------

    def unwritten(self) -> list[str]:
        """Names of the parameters and buffers no rule has set yet."""
        return [name for name, tensor in self._tensors.items() if id(tensor) not in self._written]

    def _fill(self, tensor: torch.Tensor, rows: Callable[[int, int, int], torch.Tensor]) -> None:
        """Write this rank's part of the whole tensor whose rows ``[start, stop)`` of chunk ``c``
        are ``rows(c, start, stop)``, one chunk at a time, skipping chunks it holds nothing of."""
        local = _local(tensor)
        if tensor.ndim == 0:
            local.copy_(rows(0, 0, 1).reshape(()))
            self._written.add(id(tensor))
            return
        indices = local_indices(tensor)
        # Dimensions after the first that this rank holds only part of (tensor parallelism's
        # row-wise split of w2/wo: Shard(1)): selected from every chunk.
        partial = (
            []
            if indices is None
            else [d for d in range(1, tensor.ndim) if not _is_arange(indices[d], 0, tensor.shape[d])]
        )
        for chunk, start, stop in _chunks(tuple(tensor.shape)):
            if indices is None:
                local[start:stop].copy_(rows(chunk, start, stop))
                continue
            wanted = indices[0]
            positions = ((wanted >= start) & (wanted < stop)).nonzero().flatten()
            if positions.numel() == 0:
                continue
            block = rows(chunk, start, stop)
            block = block.index_select(0, (wanted[positions] - start).to(block.device))
            for dim in partial:
                block = block.index_select(dim, indices[dim].to(block.device))
            block = block.to(local.device, local.dtype)
            if _is_arange(positions, int(positions[0]), len(positions)):  # contiguous local rows: a slice
                first = int(positions[0])
                local[first : first + len(positions)].copy_(block)
            else:
                local.index_copy_(0, positions.to(local.device), block)
        self._written.add(id(tensor))


def _chunks(shape: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    step = _rows_per_chunk(shape)
    for chunk, start in enumerate(range(0, shape[0], step)):
        yield chunk, start, min(shape[0], start + step)


def _is_arange(index: torch.Tensor, start: int, length: int) -> bool:
    """Whether ``index`` is ``start, start + 1, ..., start + length - 1``."""
    return len(index) == length and bool(
        torch.equal(index.cpu(), torch.arange(start, start + length, dtype=index.dtype))
    )


def _check_signature(module: nn.Module, init_weights: Callable[..., Any]) -> None:
    """``init_weights`` takes one Initializer. The earlier form, ``init_weights(std,
    residual_std)`` drawing from torch's global generator, cannot work on a sharded, meta-built
    model: refuse it with what to change rather than fail inside it."""
    try:
        parameters = list(inspect.signature(init_weights).parameters.values())
    except (TypeError, ValueError):  # a builtin or C extension: assume the current form
        return
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 1 or any(p.name in ("std", "residual_std") for p in positional):
        where = f"{type(module).__module__}.{type(module).__qualname__}"
        raise PluginError(
            f"{where}.init_weights takes ({', '.join(p.name for p in positional)}), the form before "
            "layout-independent initialisation; it must take one forge_lm.components.Initializer: "
            "def init_weights(self, init): init.normal(self.w, init.std) ... (see docs/distributed.md, "
            "'Initialisation')."
        )


def model_stds(model: nn.Module) -> tuple[float, float]:
    """``(init_std, init_std / sqrt(2 * n_layers))`` of a model (or a stage of one), from the
    options it keeps as ``model.config``; a family whose options have no ``n_layers`` gets
    ``init_std`` for its residual projections too."""
    config = model.config
    n_layers = getattr(config, "n_layers", None)
    if not isinstance(n_layers, int) or n_layers < 1:
        return config.init_std, config.init_std
    return config.init_std, config.init_std / math.sqrt(2 * n_layers)


def initialize(module: nn.Module, seed: int, std: float | None = None, residual_std: float | None = None) -> None:
    """Initialise every parameter and buffer of ``module`` by its rules (:meth:`Initializer.module`),
    names taken from ``module`` as the root; ``std`` (and ``residual_std``) default to the
    transformer's, from ``module.config``. Raises a PluginError naming any tensor no rule set."""
    if std is None:
        std, default_residual = model_stds(module)
        residual_std = default_residual if residual_std is None else residual_std
    init = Initializer(module, seed, std, residual_std)
    init.module(module)
    missing = init.unwritten()
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise PluginError(
            f"no initialisation rule set {shown}. The module that owns a parameter or buffer must set it "
            "in init_weights(init) (init.normal, init.zeros, init.ones, init.copy): a model built on the "
            "meta device for a sharded run has no other values."
        )


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Give a model built on the meta device (and already transformed: sharded, split into a
    stage) memory on ``device``, this rank's shards only, and initialise it there."""
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    _tie_again(shared)
    initialize(model, seed)


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold one parameter (tied embeddings)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _tie_again(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """``to_empty`` gives each holder its own new tensor unless it swaps in place: tie them again."""
    for (first, first_name), *others in groups:
        param = getattr(first, first_name)
        for module, name in others:
            if getattr(module, name) is not param:
                setattr(module, name, param)
