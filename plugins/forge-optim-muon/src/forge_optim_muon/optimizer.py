"""Muon (Jordan et al. 2024) for hidden weight matrices, with an AdamW fallback for everything else.

Per Muon parameter ``W`` (a matrix, or a stack of them such as ``[experts, rows, cols]``), with
gradient ``G`` and momentum buffer ``B`` (zero at the start)::

    B <- momentum * B + (1 - momentum) * G                      # torch.optim.Muon's convention
    U <- (1 - momentum) * G + momentum * B  (nesterov)  or  B
    O <- NS(U / max(||U||_F, ns_eps))                           # per matrix, over the last two dims
    W <- W * (1 - lr * weight_decay)                            # decoupled weight decay
    W <- W - lr * scale(rows, cols) * O

``NS`` is ``ns_steps`` iterations of ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and
``(a, b, c) = ns_coefficients``, computed on the wide orientation of each matrix (transposed when
it has more rows than columns, so that ``A`` is the smaller Gram matrix). The default quintic
moves every singular value of the normalised update that is not tiny into roughly [0.7, 1.2]:
``O`` is close to ``P Q^T`` of the SVD ``U = P S Q^T``. ``scale`` is ``sqrt(max(1, rows / cols))`` (``"original"``) or
``0.2 * sqrt(max(rows, cols))`` (``"match_rms_adamw"``: updates with AdamW's RMS).

Every formula, including the order of the bf16 roundings, is that of ``torch.optim.Muon``, so
with ``ns_dtype = "bfloat16"`` this optimizer computes what it computes on 2-D parameters.

Scale:

- Matrices of the same shape (and settings) are orthogonalised together, one batched matmul
  per Newton-Schulz product, instead of one small matmul at a time. A stacked parameter
  ``[experts, rows, cols]`` joins the batch of its ``rows x cols`` matrices.
- ``ns_dtype``: ``"bfloat16"`` (as reference implementations: accurate enough, since the
  iteration only aims at singular values near 1), ``"float32"``, or ``"auto"``: bfloat16 on
  CUDA and on CPUs with bf16 matrix instructions, float32 elsewhere (CPUs without them emulate
  bf16 matmuls, many times slower).
- Parameters that are DTensors (FSDP2, HSDP or tensor-parallel shards) are orthogonalised as
  whole matrices, a bounded group at a time: the matrices of one shape are cut into groups of
  at most ``gather_bucket_mb`` MiB (whole, in the update's dtype; a larger matrix is a group
  of its own), so the extra memory of a step is a small multiple of one group (the gathered
  updates, the Newton-Schulz batch, the gathered results), not every matrix of the model. A
  group's updates are all-gathered in one collective per placement, every rank of the
  parameters' mesh (all of its dimensions: HSDP's replicas and shards, or the tensor-parallel
  ranks) orthogonalises an equal share of the group, and all-gathers along each mesh
  dimension share the results; each rank then applies its own shard, and the group is freed
  before the next is gathered. Momentum and the AdamW fallback stay shard-local (a gradient
  placed otherwise than its parameter is redistributed like it first). Groups cut the
  batches, never a matrix, and each matrix's Newton-Schulz is computed alone in its batch,
  so the result does not depend on the budget.

AdamW groups (``algorithm = "adamw"``) run ``torch.optim.AdamW``'s update (decoupled weight
decay, bias correction) with their own ``lr``, ``betas``, ``eps`` and ``weight_decay``. A
scheduler scales every group's ``lr`` by the same factor, so the fallback follows the schedule.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from forge_lm.api import cpu_multiplies_bf16

QUINTIC = (3.4445, -4.7750, 2.0315)
GATHER_BUCKET_MB = 512.0  # default bound on the whole matrices gathered at once (MiB)
UPDATE_SCALES = ("original", "match_rms_adamw")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# -- Newton-Schulz -------------------------------------------------------------------------------


def newton_schulz(
    batch: torch.Tensor, coefficients: Sequence[float] = QUINTIC, steps: int = 5, eps: float = 1e-7
) -> torch.Tensor:
    """Orthogonalise each matrix of ``batch`` ``[n, rows, cols]`` (``rows <= cols``), in its dtype.

    Each matrix is divided by its Frobenius norm (at least ``eps``), then ``steps`` iterations of
    ``X <- a X + (b A + c A @ A) @ X`` with ``A = X @ X^T`` run as batched matmuls.
    """
    a, b, c = coefficients
    x = batch / torch.linalg.vector_norm(batch, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def orthogonalize(
    update: torch.Tensor,
    coefficients: Sequence[float] = QUINTIC,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``NS`` of every matrix of ``update`` ``[..., rows, cols]``, computed in ``dtype``, in ``update``'s dtype."""
    rows, cols = update.shape[-2:]
    batch = update.reshape(-1, rows, cols).to(dtype)
    tall = rows > cols
    out = newton_schulz(batch.mT if tall else batch, coefficients, steps, eps)
    return (out.mT if tall else out).reshape(update.shape).to(update.dtype)


def update_scale(rule: str, rows: int, cols: int) -> float:
    """The factor on ``lr`` for a ``rows x cols`` matrix's orthogonalised update."""
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"update_scale must be one of {UPDATE_SCALES}, got {rule!r}")


def resolve_ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz dtype ``ns_dtype = name`` means on ``device``. ``"auto"``: bfloat16
    where the hardware multiplies bf16 matrices (CUDA; a CPU with AVX-512 BF16 or AMX, where
    ``benchmarks/bench_muon.py`` measured it 3.6x faster than float32), float32 elsewhere (a CPU
    without them emulates bf16 matmuls, tens of times slower than float32)."""
    if name == "auto":
        fast_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_multiplies_bf16())
        return torch.bfloat16 if fast_bf16 else torch.float32
    if name not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be 'auto', 'bfloat16' or 'float32', got {name!r}")
    return NS_DTYPES[name]


# -- the optimizer ---------------------------------------------------------------------------------


class Muon(torch.optim.Optimizer):
    """Muon on groups with ``algorithm = "muon"`` (the default), AdamW on ``algorithm = "adamw"`` groups.

    The constructor's Muon arguments are the defaults of Muon groups, its ``adamw_*`` arguments
    those of AdamW groups; a group may set any of its algorithm's keys itself. Muon group keys:
    ``lr, momentum, nesterov, weight_decay, update_scale, ns_coefficients, ns_steps, ns_eps,
    ns_dtype``; AdamW group keys: ``lr, betas, eps, weight_decay``. State per Muon parameter:
    ``momentum_buffer``; per AdamW parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (as
    ``torch.optim.AdamW``). :func:`forge_optim_muon.factory.build_muon` builds the groups of a
    model by the role of each parameter. ``gather_bucket_mb`` bounds the whole matrices a step
    holds at once (see the module docstring); it is the optimizer's, not a group's.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        update_scale: str = "original",
        ns_coefficients: Sequence[float] = QUINTIC,
        ns_steps: int = 5,
        ns_eps: float = 1e-7,
        ns_dtype: str = "auto",
        adamw_lr: float = 3e-3,
        adamw_betas: Sequence[float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        gather_bucket_mb: float = GATHER_BUCKET_MB,
    ) -> None:
        if not (isinstance(gather_bucket_mb, int | float) and math.isfinite(gather_bucket_mb) and gather_bucket_mb > 0):
            raise ValueError(f"gather_bucket_mb must be a positive number of MiB, got {gather_bucket_mb!r}")
        # Bytes of whole matrices (gathered shards of DTensors) held at once during a step.
        self.gather_bucket_bytes = max(1, int(gather_bucket_mb * 2**20))
        self._group_defaults = {
            "muon": {
                "lr": lr,
                "momentum": momentum,
                "nesterov": nesterov,
                "weight_decay": weight_decay,
                "update_scale": update_scale,
                "ns_coefficients": tuple(ns_coefficients),
                "ns_steps": ns_steps,
                "ns_eps": ns_eps,
                "ns_dtype": ns_dtype,
            },
            "adamw": {
                "lr": adamw_lr,
                "betas": tuple(adamw_betas),
                "eps": adamw_eps,
                "weight_decay": adamw_weight_decay,
            },
        }
        super().__init__(params, {})  # each group is completed from its algorithm's defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.setdefault("algorithm", "muon")
        if algorithm not in self._group_defaults:
            raise ValueError(f"a param group's algorithm must be 'muon' or 'adamw', got {algorithm!r}")
        for key, value in self._group_defaults[algorithm].items():
            param_group.setdefault(key, value)
        if algorithm == "muon":
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group["params"] = params
            for param in params:
                if param.ndim < 2:
                    raise ValueError(
                        f"Muon orthogonalises matrices; a parameter of shape {tuple(param.shape)} belongs in an "
                        "'adamw' group"
                    )
            update_scale(param_group["update_scale"], 1, 1)  # validates the rule's name
            resolve_ns_dtype(param_group["ns_dtype"], torch.device("cpu"))
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_groups = []
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
            else:
                muon_groups.append(group)
        if muon_groups:
            self._muon_step(muon_groups)
        return loss

    # -- AdamW ----------------------------------------------------------------------------------

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """``torch.optim.AdamW``'s foreach update, on the local shards of the group's parameters."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(_local(param))
            grads.append(_local_grad(param))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1.0)
        if decay != 0:
            torch._foreach_mul_(params, 1.0 - lr * decay)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
        counts = [step.item() for step in steps]
        step_sizes = [-lr / (1.0 - beta1**t) for t in counts]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [math.sqrt(1.0 - beta2**t) for t in counts])
        torch._foreach_add_(denominators, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)

    # -- Muon -----------------------------------------------------------------------------------

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        entries: list[_Entry] = []
        for group in groups:
            stepped = [p for p in group["params"] if p.grad is not None]
            if not stepped:
                continue
            buffers = []
            for param in stepped:
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                buffers.append(_local(state["momentum_buffer"]))
            grads = [_local_grad(p) for p in stepped]
            momentum = group["momentum"]
            torch._foreach_lerp_(buffers, grads, 1.0 - momentum)
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            entries.extend(_Entry(p, group, u) for p, u in zip(stepped, updates, strict=True))
        for bucket in _buckets(entries, self.gather_bucket_bytes):
            _gather_whole_matrices(bucket)
            _orthogonalize_in_batches(bucket)
            _take_local_shards(bucket)
            for entry in bucket:
                group, param = entry.group, _local(entry.param)
                lr, decay = group["lr"], group["weight_decay"]
                rows, cols = entry.param.shape[-2:]
                if decay != 0:
                    param.mul_(1.0 - lr * decay)
                param.add_(entry.result, alpha=-lr * update_scale(group["update_scale"], rows, cols))
                entry.full = entry.result = None  # this group's whole matrices go before the next is gathered


class _Entry:
    """One Muon parameter through a step: its update, the whole matrix, the orthogonalised result."""

    __slots__ = ("full", "group", "param", "result", "update")

    def __init__(self, param: torch.Tensor, group: dict[str, Any], update: torch.Tensor) -> None:
        self.param, self.group = param, group
        self.update = update  # local (this rank's shard of a DTensor parameter)
        self.full: torch.Tensor | None = None  # the whole update matrix (or stack), on every rank
        self.result: torch.Tensor | None = None  # NS(full), then this rank's shard of it

    @property
    def mesh(self) -> Any:
        return self.param.device_mesh if isinstance(self.param, DTensor) else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``'s gradient, laid out as its part of ``param``.

    Under tensor parallelism a gradient can come back placed otherwise than its parameter (a
    partial sum, or replicated, where the weight is sharded): it is redistributed to the
    parameter's placements first, so that every local tensor of a step lines up with the
    parameter's shard and the state stays sharded like it.
    """
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return _local(grad)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def _stacked_placements(placements: Sequence[Any]) -> list[Any] | None:
    """The placements of ``[k, *shape]`` stacking ``k`` tensors placed as ``placements``, or None."""
    out = []
    for placement in placements:
        if type(placement) is Shard:
            out.append(Shard(placement.dim + 1))
        elif type(placement) is Replicate:
            out.append(placement)
        else:  # partial sums, strided shards: gather each tensor on its own
            return None
    return out


def _sharding_groups(entries: list[_Entry]) -> dict[Any, list[_Entry]]:
    groups: dict[Any, list[_Entry]] = {}
    for entry in entries:
        if entry.mesh is not None:
            key = (id(entry.mesh), tuple(entry.param.placements), tuple(entry.param.shape), entry.update.dtype)
            groups.setdefault(key, []).append(entry)
    return groups


def _gather_whole_matrices(entries: list[_Entry]) -> None:
    """``entry.full``: the whole update; one all-gather per group of same-shape, same-placement DTensors."""
    for entry in entries:
        if entry.mesh is None:
            entry.full = entry.update
    for group in _sharding_groups(entries).values():
        param = group[0].param
        placements = _stacked_placements(param.placements)
        if placements is None:
            for entry in group:
                p = entry.param
                entry.full = DTensor.from_local(
                    entry.update, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                ).full_tensor()
            continue
        shape = (len(group), *param.shape)
        stacked = DTensor.from_local(
            torch.stack([entry.update for entry in group]),
            param.device_mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=_contiguous_stride(shape),
        ).full_tensor()
        for entry, full in zip(group, stacked.unbind(0), strict=True):
            entry.full = full


def _take_local_shards(entries: list[_Entry]) -> None:
    """Replace each DTensor parameter's whole result by this rank's shard of it (no communication)."""
    for group in _sharding_groups(entries).values():
        param = group[0].param
        mesh, placements = param.device_mesh, _stacked_placements(param.placements)
        if placements is None:
            for entry in group:
                p = entry.param
                whole = DTensor.from_local(entry.result, mesh, [Replicate()] * mesh.ndim, run_check=False)
                entry.result = whole.redistribute(mesh, p.placements).to_local()
            continue
        stacked = torch.stack([entry.result.to(entry.update.dtype) for entry in group])
        whole = DTensor.from_local(stacked, mesh, [Replicate()] * mesh.ndim, run_check=False)
        shards = whole.redistribute(mesh, placements).to_local()
        for entry, shard in zip(group, shards.unbind(0), strict=True):
            entry.result = shard


def _batch_key(entry: _Entry) -> tuple[Any, ...]:
    """What matrices must share to be orthogonalised in one batch: shape, device, settings, mesh."""
    group, device = entry.group, entry.update.device
    return (
        tuple(entry.param.shape[-2:]),
        device,
        resolve_ns_dtype(group["ns_dtype"], device),
        tuple(group["ns_coefficients"]),
        group["ns_steps"],
        group["ns_eps"],
        None if entry.mesh is None else id(entry.mesh),
    )


def _buckets(entries: list[_Entry], budget: int) -> Iterator[list[_Entry]]:
    """``entries`` cut into groups of one batch each whose whole matrices (in the update's dtype)
    take at most ``budget`` bytes; a matrix larger than the budget is a group of its own.

    Every rank of a mesh cuts alike (the entries come in the order of the param groups, the same
    everywhere), so the collectives of each group match across ranks.
    """
    batches: dict[tuple[Any, ...], list[_Entry]] = {}
    for entry in entries:
        batches.setdefault(_batch_key(entry), []).append(entry)
    for members in batches.values():
        bucket: list[_Entry] = []
        size = 0
        for entry in members:
            nbytes = entry.param.numel() * entry.update.element_size()
            if bucket and size + nbytes > budget:
                yield bucket
                bucket, size = [], 0
            bucket.append(entry)
            size += nbytes
        if bucket:
            yield bucket


def _orthogonalize_in_batches(entries: list[_Entry]) -> None:
    """``entry.result = NS(entry.full)``, one batch per matrix shape and settings.

    A batch is the matrices stacked as stored, ``[n, rows, cols]``; a tall batch is orthogonalised
    through its transposed view, so each matrix is seen in exactly the layout torch.optim.Muon
    gives it (in bfloat16 the layout changes a matmul's rounding).
    """
    batches: dict[tuple[Any, ...], list[_Entry]] = {}
    for entry in entries:
        batches.setdefault(_batch_key(entry), []).append(entry)
    for ((rows, cols), _, dtype, coefficients, steps, eps, _), members in batches.items():
        batch = torch.cat([entry.full.reshape(-1, rows, cols) for entry in members]).to(dtype)
        orthogonalise = functools.partial(_stored_layout_newton_schulz, coefficients=coefficients, steps=steps, eps=eps)
        mesh = members[0].mesh
        if mesh is not None and mesh.size() > 1:
            out = _spread(orthogonalise, batch, mesh, members[0].update.dtype)
        else:
            out = orthogonalise(batch)
        offset = 0
        for entry in members:
            count = entry.full.numel() // (rows * cols)
            entry.result = out[offset : offset + count].reshape(entry.full.shape)
            offset += count


def _stored_layout_newton_schulz(
    matrices: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float
) -> torch.Tensor:
    """NS of ``[n, rows, cols]``; a tall batch goes through its transposed view (the smaller Gram matrix)."""
    if matrices.shape[-2] > matrices.shape[-1]:
        return newton_schulz(matrices.mT, coefficients, steps, eps).mT
    return newton_schulz(matrices, coefficients, steps, eps)


def _spread(
    orthogonalise: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor, mesh: Any, out_dtype: torch.dtype
) -> torch.Tensor:
    """``orthogonalise(batch)`` with the work split over every rank of ``mesh``, of any number of
    dimensions: each rank takes an equal share of the (zero-padded) batch, the share of its
    row-major position in the mesh, and all-gathers along the mesh dimensions, innermost first,
    give every rank every result (after the innermost, a rank holds its row's consecutive shares;
    each further gather joins consecutive rows). No process group beyond the mesh's own is made."""
    sizes = tuple(mesh.shape)
    position = 0
    for coordinate, size in zip(mesh.get_coordinate(), sizes, strict=True):
        position = position * size + coordinate
    count = batch.shape[0]
    share = -(-count // mesh.size())
    if share * mesh.size() != count:  # zero matrices stay zero: 0 / max(0, eps) = 0
        batch = torch.cat([batch, batch.new_zeros(share * mesh.size() - count, *batch.shape[1:])])
    gathered = orthogonalise(batch[position * share : (position + 1) * share]).to(out_dtype).contiguous()
    for dim in reversed(range(mesh.ndim)):
        if sizes[dim] == 1:
            continue
        joined = gathered.new_empty(sizes[dim] * gathered.shape[0], *gathered.shape[1:])
        dist.all_gather_single(joined, gathered, group=mesh.get_group(dim))
        gathered = joined
    return gathered[:count]
