"""PowerSGD: gradients reduced across HSDP's replicas as low-rank factors, with error feedback.

FSDP2 offers no hook that replaces HSDP's own all-reduce, but ``FSDPModule.set_all_reduce_hook``
hands a hook the reduce-scatter output when a unit is sharded over a 1-D mesh. So under
``[distributed.compression] method = "powersgd"`` each unit is sharded over ``dp_shard`` only
(FSDP2 reduce-scatters and averages there, in ``reduce_dtype``) and the hook reduces the shard
across ``dp_replicate`` itself: rank ``(r, s)`` and rank ``(r', s)`` hold the same shard of every
parameter, so their matrices line up.

For each shard ``M`` (the parameter's rows on this rank, its other dimensions flattened) worth
compressing, with ``Q`` the previous step's factor (warm start; random at first, the same on
every replica)::

    M  <- M + e                       (error feedback: what earlier compressions left out)
    P  =  orthonormal(sum_replicas(M Q))            one all-reduce of every P of the unit
    Qi =  M^T P                                     this replica's right factor
    Q  =  sum_replicas(Qi) / replicas               one all-reduce of every Q of the unit
    M' =  P Q^T                       the mean over the replicas, rank-r approximated
    e  <- M - P Qi^T                  what this replica's share lost: (I - P P^T) M

Vectors (norm scales, biases) and matrices whose factors would not be at most half their size
are averaged whole, in one all-reduce with the unit's other such tensors. The first
``warmup_steps`` reductions of each unit are plain averages (as torch's ``start_powerSGD_iter``).
The algorithm is Vogels et al.'s (2019), also in torch's DDP hook
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``; the error kept here is the
paper's (this replica's projection residual), whose mean over the replicas is the residual of
the mean that torch's hook keeps.

A gradient that is not finite (an fp16 overflow, a bad batch) leaves the error and the warm
start as they were: the step is skipped by the loop, and the state must not carry the NaN on.
The state (each rank's errors and factors, and the reductions counted: :meth:`PowerSGD.state_dict`)
is saved in the checkpoint as the rank's own, which a resume reads back on that rank only.
"""

from __future__ import annotations

import weakref
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from forge_lm.errors import ConfigError

MIN_COMPRESSION_RATE = 2  # compress a matrix only when P and Q together are at most half its size

# The compressor serving a model's units, by model: the checkpoint finds it here (run_state).
_COMPRESSORS: weakref.WeakKeyDictionary[nn.Module, PowerSGD] = weakref.WeakKeyDictionary()


def compressor_of(model: nn.Module) -> PowerSGD | None:
    """The gradient compressor installed on ``model``'s FSDP units, if any."""
    return _COMPRESSORS.get(model)


def compression_problems(config: Any, dims: Any) -> list[str]:
    """Why ``[distributed.compression]`` cannot run on this layout (an empty list when it can):
    it needs a replicated dimension, and is written for data parallelism alone."""
    section = config.distributed.compression
    if section.method == "none":
        return []
    setting = f'[distributed.compression] method = "{section.method}"'
    problems = []
    if dims.dp_replicate < 2:
        problems.append(
            f"{setting} compresses the reduction across replicas and needs dp_replicate >= 2 (now "
            f'{dims.dp_replicate}); set dp_replicate, or method = "none"'
        )
    for name in ("tp", "pp", "cp", "ep"):
        degree = getattr(dims, name)
        if degree > 1:
            problems.append(f"{setting} is not supported with {name} = {degree} yet; set {name} = 1 or method = 'none'")
    train = config.train
    if train.precision == "fp16":
        problems.append(
            f'{setting} is not supported with [train] precision = "fp16": the error feedback would mix loss '
            "scales; use bf16 or fp32"
        )
    accumulates = train.grad_accum_steps > 1 or getattr(getattr(train, "batch_ramp", None), "start_batch_size", None)
    if accumulates and not config.distributed.defer_grad_reduction:
        problems.append(
            f"{setting} with gradient accumulation needs [distributed] defer_grad_reduction = true, so that a "
            "step's gradients are compressed once rather than each micro-batch's"
        )
    return problems


class PowerSGD:
    """The compressed reduction across ``group`` (the ``dp_replicate`` ranks) for every FSDP unit
    it is installed on, and the state it keeps between steps."""

    def __init__(self, rank: int, warmup_steps: int, error_feedback: bool, group: Any, seed: int) -> None:
        self.approximation_rank, self.warmup_steps, self.error_feedback = rank, warmup_steps, error_feedback
        self.group, self.seed = group, seed
        self.replicas = dist.get_world_size(group)
        self.reductions: dict[str, int] = {}  # per unit: how many reductions it has done
        self.errors: dict[str, torch.Tensor] = {}  # per parameter name: this rank's error, fp32
        self.factors: dict[str, torch.Tensor] = {}  # per parameter name: the warm-start Q, fp32
        self._names: dict[nn.Parameter, str] | None = None
        self._model: weakref.ref[nn.Module] | None = None

    def install(self, model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
        """Reduce the gradients of ``units`` (``(name, FSDP module)``, each sharded over
        ``dp_shard`` alone) across the replicas with this compressor."""
        self._model = weakref.ref(model)
        for name, unit in units:
            self.reductions.setdefault(name, 0)
            unit.set_all_reduce_hook(lambda flat, name=name, unit=unit: self._reduce(name, unit, flat))
        _COMPRESSORS[model] = self

    # -- the reduction --------------------------------------------------------------------------

    @torch.no_grad()
    def _reduce(self, unit_name: str, unit: nn.Module, flat: torch.Tensor) -> None:
        """Replace ``flat`` (the unit's reduce-scatter output: its gradient shards, averaged over
        ``dp_shard``) by its mean over the replicas."""
        count = self.reductions[unit_name]
        self.reductions[unit_name] = count + 1
        shards = self._shards(unit, flat)
        if count < self.warmup_steps or shards is None:  # warming up, or a layout this does not know
            self._average(flat)
            return
        compressed, whole = [], []
        for name, view in shards:
            matrix = view.reshape(view.shape[0], -1) if view.ndim else view.reshape(1, 1)
            rows, cols = matrix.shape
            rank = min(rows, cols, self.approximation_rank)
            if view.ndim >= 2 and rank and (rows + cols) * rank * MIN_COMPRESSION_RATE <= rows * cols:
                compressed.append((name, matrix, rank))
            else:
                whole.append(view)
        if whole:
            buffer = torch.cat([v.reshape(-1) for v in whole])
            self._average(buffer)
            offset = 0
            for view in whole:
                view.copy_(buffer[offset : offset + view.numel()].view_as(view))
                offset += view.numel()
        if compressed:
            self._compress(compressed)

    def _compress(self, compressed: list[tuple[str, torch.Tensor, int]]) -> None:
        inputs = []
        for name, matrix, _ in compressed:
            value = matrix.float()
            error = self.errors.get(name) if self.error_feedback else None
            if error is not None and error.shape == value.shape:  # another shape: saved on another layout
                value = value + error
            inputs.append(value)
        factors = [
            self._factor(name, m.shape[1], rank, m.device)
            for (name, _, rank), m in zip(compressed, inputs, strict=True)
        ]
        step = LowRankStep(inputs, factors)
        left = step.left_factors()
        dist.all_reduce(left, group=self.group)
        right = step.right_factors(left)
        dist.all_reduce(right, group=self.group)
        means, errors, new_factors = step.finish(right, self.replicas)
        for (name, matrix, _), mean, error, factor, old in zip(
            compressed, means, errors, new_factors, factors, strict=True
        ):
            matrix.copy_(mean)
            # A non-finite gradient (the step will be skipped) must not poison the state.
            self.factors[name] = torch.where(torch.isfinite(factor), factor, old)
            if self.error_feedback:
                kept = self.errors.get(name)
                fresh = kept is None or kept.shape != error.shape
                self.errors[name] = error if fresh else torch.where(torch.isfinite(error), error, kept)

    def _average(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)  # a sum (gloo has no average), then the division
        tensor.div_(self.replicas)

    def _factor(self, name: str, cols: int, rank: int, device: torch.device) -> torch.Tensor:
        """The warm-start Q of ``name``, or a random one drawn from (seed, name): the same on every
        replica (they hold the same shard), whatever the order in which units reduce."""
        factor = self.factors.get(name)
        if factor is not None and factor.shape == (cols, rank):
            return factor
        generator = torch.Generator().manual_seed((self.seed << 32) + zlib.crc32(name.encode()))
        return torch.randn(cols, rank, generator=generator).to(device)

    def _shards(self, unit: nn.Module, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """``(parameter name, its gradient shard as a view of flat)`` for the unit's trainable
        parameters, laid out as FSDP2's reduce-scatter output lays them out (each shard padded to
        its padded size, in the unit's parameter order); None when ``flat`` does not have that
        size (a parameter without a gradient this step): the caller then averages it whole."""
        # torch 2.13's FSDP2 keeps the layout in its (private) parameter group; a unit of Forge's has one.
        group = unit._get_fsdp_state()._fsdp_param_groups[0]
        if self._names is None or any(p.sharded_param not in self._names for p in group.fsdp_params):
            self._names = self._parameter_names()
        names = self._names
        shards, offset = [], 0
        for fsdp_param in group.fsdp_params:
            if not fsdp_param.sharded_param.requires_grad:
                continue  # never has a gradient: not in the reduce-scatter output
            size = fsdp_param.sharded_size
            view = torch.as_strided(flat, size, fsdp_param.contiguous_sharded_stride, flat.storage_offset() + offset)
            shards.append((names.get(fsdp_param.sharded_param, f"?{len(shards)}"), view))
            offset += fsdp_param.padded_sharded_param_size.numel()
        return shards if offset == flat.numel() else None

    def _parameter_names(self) -> dict[nn.Parameter, str]:
        """The model's parameters by object. Looked up again when one is missing: materializing
        the model and FSDP2's lazy initialisation may replace the parameter objects."""
        model = self._model() if self._model is not None else None
        return {p: name for name, p in model.named_parameters()} if model is not None else {}

    # -- the checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (the errors differ between ranks: the trainer state keeps it as this
        rank's own, and a resume hands each rank its own back)."""
        return {
            "reductions": dict(self.reductions),
            "replicas": self.replicas,
            "errors": dict(self.errors),
            "factors": dict(self.factors),
        }

    def load_state_dict(self, saved: Any) -> str | None:
        """Take ``saved``, this rank's state from a checkpoint (untrusted; None: it holds none for
        this rank). A state that is damaged (wrong kinds, shapes or dtypes, values that are not
        finite) raises ValueError: the checkpoint is passed over. A checkpoint without it (written
        without compression, or with other replicas or ranks) leaves the state fresh; the return
        value says why (None: loaded)."""
        mine = saved
        if isinstance(saved, dict) and saved and all(isinstance(k, str) and k.startswith("rank") for k in saved):
            # Checkpoints written before per-rank entries (forge_lm.checkpoint.PerRank) held
            # every rank's state, each under "rank<N>".
            mine = saved.get(f"rank{dist.get_rank() if dist.is_initialized() else 0}")
        if mine is None:
            self._reset()
            return "the checkpoint holds no compression state for this rank; it starts afresh"
        if not isinstance(mine, dict) or set(mine) != {"reductions", "replicas", "errors", "factors"}:
            raise ValueError("its gradient compression state is not what Forge writes")
        if mine["replicas"] != self.replicas:
            self._reset()
            return f"the checkpoint's compression state is for {mine['replicas']} replicas; it starts afresh"
        reductions = mine["reductions"]
        if not isinstance(reductions, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in reductions.values()
        ):
            raise ValueError("its gradient compression state counts reductions wrongly")
        errors = _checked_tensors(mine["errors"], "errors", matrix=True)
        factors = _checked_tensors(mine["factors"], "factors", matrix=True)
        device = next(iter(self._parameter_names()), torch.empty(0)).device  # where the gradients are
        for name in self.reductions:
            self.reductions[name] = reductions.get(name, 0)
        self.errors = {name: t.to(device) for name, t in errors.items()}
        self.factors = {name: t.to(device) for name, t in factors.items()}
        return None

    def _reset(self) -> None:
        self.reductions = dict.fromkeys(self.reductions, 0)
        self.errors, self.factors = {}, {}


def _checked_tensors(value: Any, what: str, matrix: bool) -> dict[str, torch.Tensor]:
    if not isinstance(value, dict):
        raise ValueError(f"its gradient compression {what} are not a table of tensors")
    for name, tensor in value.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or (matrix and tensor.ndim != 2):
            raise ValueError(f"its gradient compression {what} of '{name}' are not a float32 matrix")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"its gradient compression {what} of '{name}' are not finite")
    return value


class LowRankStep:
    """One PowerSGD round over one replica's matrices, in three parts around the two sums over
    the replicas (the caller all-reduces what :meth:`left_factors` and :meth:`right_factors`
    return), so that one process can play several replicas (tests) and the hook one."""

    def __init__(self, matrices: list[torch.Tensor], factors: list[torch.Tensor]) -> None:
        self.matrices, self.factors = matrices, factors

    def left_factors(self) -> torch.Tensor:
        """``M Q`` of every matrix, flattened into one buffer."""
        return torch.cat([(m @ q).reshape(-1) for m, q in zip(self.matrices, self.factors, strict=True)])

    def right_factors(self, left_sum: torch.Tensor) -> torch.Tensor:
        """``M^T P`` with ``P`` the orthonormalised sum of the left factors, one buffer."""
        self.bases = []
        offset = 0
        for m, q in zip(self.matrices, self.factors, strict=True):
            rows, rank = m.shape[0], q.shape[1]
            p = left_sum[offset : offset + rows * rank].view(rows, rank)
            offset += rows * rank
            self.bases.append(torch.linalg.qr(p).Q)  # reduced QR; a zero P gives a basis, not NaN
        self.rights = [m.T @ p for m, p in zip(self.matrices, self.bases, strict=True)]
        return torch.cat([r.reshape(-1) for r in self.rights])

    def finish(
        self, right_sum: torch.Tensor, replicas: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(the means P Q^T, this replica's errors M - P Qi^T, the next warm-start Qs)``."""
        means, errors, factors = [], [], []
        offset = 0
        for m, p, mine in zip(self.matrices, self.bases, self.rights, strict=True):
            cols, rank = mine.shape
            q = right_sum[offset : offset + cols * rank].view(cols, rank) / replicas
            offset += cols * rank
            means.append(p @ q.T)
            errors.append(m - p @ mine.T)
            factors.append(q)
        return means, errors, factors


def build_compressor(context: Any) -> PowerSGD | None:
    """The compressor ``[distributed.compression]`` asks for on this layout (a
    :class:`~forge_lm.distributed.transforms.TransformContext`'s), or None."""
    config = context.config
    section = config.distributed.compression
    if section.method == "none":
        return None
    problems = compression_problems(config, context.dims)
    if problems:
        raise ConfigError("[distributed] " + "; ".join(problems) + ".")
    group = context.submesh("dp_replicate").get_group()
    return PowerSGD(section.rank, section.warmup_steps, section.error_feedback, group, config.train.seed)
