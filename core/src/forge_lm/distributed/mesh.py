"""Parallel degrees: checked against the world size and the model, then laid out as a device mesh.

The mesh has four dimensions, outermost first::

    pp x dp_replicate x dp_shard x tp

With expert parallelism (``ep > 1``) ``dp_shard`` is itself split in two, ``efsdp x ep``, and
flattened back under the name ``dp_shard``: the ``ep`` ranks of a shard group are data-parallel
ranks that also split the experts, so every one of them reads its own slice of the global batch
(the reference gave them the same batch, which made expert gradients ``ep`` times too large).
``dp`` flattens ``dp_replicate x dp_shard``: the ranks that read different data. Ranks that
differ only in their ``tp`` or ``pp`` coordinate read the same data.

With context parallelism (``cp > 1``) the mesh is ``pp x dp_replicate x dp_shard x cp x tp``:
the ``cp`` ranks of a group split each sequence between them and read the same batch, so
``dp`` leaves ``cp`` out, while FSDP2 shards parameters over ``dp_shard_cp`` (``dp_shard x cp``
flattened), as torchtitan does. ``cp = 1`` builds the mesh above unchanged.
"""

from __future__ import annotations

import attrs
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from forge_lm.config import DistributedSection, ForgeConfig, model_options
from forge_lm.distributed.compression import compression_problems
from forge_lm.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "tp")
MESH_DIMS_NO_EP = ("pp", "dp_replicate", "dp_shard", "tp")  # ep = 1: dp_shard needs no split
MESH_DIMS_CP = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ForgeMesh:
    """The root device mesh and its flattened dimensions, addressed alike: ``mesh["tp"]``,
    ``mesh["dp"]``, ``mesh["dp_replicate", "dp_shard"]``. (torch wants flattened meshes kept by
    their creator rather than sliced out of the root again.)"""

    def __init__(self, root: DeviceMesh, flattened: dict[str, DeviceMesh]) -> None:
        self.root = root
        self.flattened = flattened

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.flattened:
            return self.flattened[names]
        return self.root[names]


@attrs.frozen
class ParallelDims:
    """Resolved degrees whose product is ``world_size`` (``dp_shard`` includes ``ep``; ``cp`` is
    last so that positional construction by older callers keeps its meaning)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def shard_size(self) -> int:
        """Ranks FSDP2 spreads each parameter over (with its replicas): the data-parallel ranks
        and, under context parallelism, the ranks that split their sequences."""
        return self.dp_size * self.cp

    @property
    def dp_size(self) -> int:
        """Ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def resolve(cls, config: ForgeConfig, world_size: int) -> ParallelDims:
        """The degrees ``config.distributed`` asks for on ``world_size`` ranks, or a ConfigError
        naming the rule broken and what to change."""
        section: DistributedSection = config.distributed
        fixed = section.dp_replicate * section.tp * section.pp * section.cp
        dp_shard = section.dp_shard
        if dp_shard == -1:
            # dp_shard fills the rest; with ep > 1 it must hold a whole number of ep groups.
            unit = fixed * section.ep
            if world_size % unit:
                names = ["dp_replicate", "tp", "pp"] + [n for n in ("cp", "ep") if getattr(section, n) > 1]
                values = " * ".join(str(getattr(section, n)) for n in names)
                raise ConfigError(
                    f"[distributed] {' * '.join(names)} = {values} = {unit} does not divide the world size "
                    f"{world_size}: this layout runs on a multiple of {unit} processes. "
                    + _launch_fixes(unit, world_size, section)
                )
            dp_shard = world_size // fixed
        dims = cls(
            section.dp_replicate, dp_shard, section.tp, section.pp, section.ep, section.pp_schedule, cp=section.cp
        )
        if dims.world_size != world_size:
            cp_factor = f" * {section.cp}" if section.cp > 1 else ""
            raise ConfigError(
                f"[distributed] pp * dp_replicate * dp_shard * {'cp * ' if section.cp > 1 else ''}tp = {section.pp} "
                f"* {section.dp_replicate} * {dp_shard}{cp_factor} * {section.tp} = {dims.world_size}, but "
                f"{world_size} processes were launched; the degrees must multiply to the world size. "
                + _launch_fixes(dims.world_size, world_size, section, fill="set dp_shard = -1 to fill the rest")
            )
        dims.check(config)
        return dims

    def check(self, config: ForgeConfig) -> None:
        """The rules that tie the degrees to the model and the batch."""
        model, train = model_options(config), config.train
        problems = []
        # The llama family's sizes; another family's options are checked for the fields they share.
        n_heads, kv_heads = getattr(model, "n_heads", None), getattr(model, "kv_heads", None)
        if self.dp_shard % self.ep:
            problems.append(
                f"ep = {self.ep} must divide dp_shard = {self.dp_shard}: expert-parallel ranks are "
                "data-parallel ranks that also split the experts"
            )
        if self.tp > 1:
            if isinstance(n_heads, int) and n_heads % self.tp:
                problems.append(f"tp = {self.tp} must divide [model] n_heads = {n_heads}")
            if isinstance(kv_heads, int) and kv_heads % self.tp:
                problems.append(f"tp = {self.tp} must divide the key/value heads ({kv_heads})")
            if train.seq_len % self.tp:
                problems.append(
                    f"tp = {self.tp} must divide [train] seq_len = {train.seq_len} (sequence parallelism "
                    "splits each sequence across the tensor-parallel ranks)"
                )
            if getattr(model, "qk_norm", False):
                problems.append("[model] qk_norm is not supported with tensor parallelism yet; set tp = 1")
        if self.pp > 1:
            n_layers = getattr(model, "n_layers", None)
            if isinstance(n_layers, int) and n_layers < self.pp:
                problems.append(f"pp = {self.pp} stages need at least {self.pp} layers; [model] n_layers = {n_layers}")
            if getattr(model, "tie_embeddings", False):
                problems.append(
                    "pipeline stages cannot share one embedding matrix between the first stage and the "
                    "last; set [model] tie_embeddings = false for pipeline parallelism"
                )
            if self.pp_schedule == "1f1b" and train.grad_accum_steps < self.pp:
                problems.append(
                    f"the 1f1b schedule needs at least pp = {self.pp} microbatches; raise [train] "
                    f"grad_accum_steps (now {train.grad_accum_steps}) or use pp_schedule = 'gpipe'"
                )
        if self.cp > 1:
            problems.extend(_context_parallel_problems(self, config))
        problems.extend(compression_problems(config, self))  # [distributed.compression] on this layout
        if config.eval.evaluators and config.eval.interval:
            # An evaluator calls the whole model's forward on whole sequences: a pipeline stage holds
            # a part of the model, and under context parallelism the model takes slices of sequences.
            for name, degree, holds in (("pp", self.pp, "each stage holds part of the model"),
                                        ("cp", self.cp, "each rank holds part of every sequence")):  # fmt: skip
                if degree > 1:
                    problems.append(
                        f"{name} = {degree} cannot run [eval] evaluators, which run the whole model on whole "
                        f"sequences on each rank ({holds}); remove them or train with {name} = 1"
                    )
        if problems:
            raise ConfigError("[distributed] " + "; ".join(problems) + ".")

    def build_mesh(self, device_type: str, one_rank: bool = False) -> ForgeMesh | None:
        """The world's device mesh: None for one process, unless ``one_rank`` asks for a mesh of
        its one rank (every dimension 1), over which FSDP2 runs ``cpu_offload`` in one process
        (the process group of :func:`forge_lm.distributed.launch.init_one_rank_group` must exist)."""
        if not self.distributed and not one_rank:
            return None
        if self.cp > 1:  # check() allows cp only with dp_replicate = tp = pp = ep = 1
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
            root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS_CP)
            shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp")
            # dp: the ranks that read different data (cp ranks share theirs); dp_cp: every rank
            # holding a distinct share of the tokens, which losses are averaged over.
            flattened = {"dp": root["dp_replicate", "dp_shard"]._flatten("dp"), "dp_shard_cp": shard_cp}
            flattened["dp_cp"] = shard_cp
        elif self.ep == 1:
            root = init_device_mesh(
                device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS_NO_EP
            )
            flattened = {"dp": root["dp_replicate", "dp_shard"]._flatten("dp")}
        else:
            shape = (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)
            root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
            flattened = {
                "dp_shard": root["efsdp", "ep"]._flatten("dp_shard"),
                "dp": root["dp_replicate", "efsdp", "ep"]._flatten("dp"),
            }
        return ForgeMesh(root, flattened)

    def describe(self) -> str:
        names = ("dp_replicate", "dp_shard", "tp", "pp", "ep") + (("cp",) if self.cp > 1 else ())
        parts = [f"{name}={getattr(self, name)}" for name in names]
        return f"{self.world_size} ranks: " + " ".join(parts)


def dp_coordinates(mesh: ForgeMesh | None) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: which slice of the global batch this rank reads."""
    if mesh is None:
        return 0, 1
    dp = mesh["dp"]
    return dp.get_local_rank(), dp.size()


def _launch_fixes(needed: int, launched: int, section: DistributedSection, fill: str | None = None) -> str:
    """The two ways out of a layout that does not fit the processes launched: launch as many as
    it needs, or lower the degrees that ask for more (each named as the override to type)."""
    lower = [
        f"--distributed.{name}=1" for name in ("tp", "pp", "cp", "ep", "dp_replicate") if getattr(section, name) > 1
    ]
    if section.dp_shard > 1:
        lower.append("--distributed.dp_shard=-1")
    fixes = [f"launch {needed} processes (torchrun --nproc_per_node={needed} -m forge_lm train ...)"]
    if lower:
        fixes.append(f"fit the layout to {launched} process{'es' if launched != 1 else ''} with {' '.join(lower)}")
    if fill:
        fixes.append(fill)
    return "Either " + ", or ".join(fixes) + "."


def _context_parallel_problems(dims: ParallelDims, config: ForgeConfig) -> list[str]:
    """What context parallelism (``cp > 1``) needs, and the combinations not supported yet."""
    train, problems = config.train, []
    if train.seq_len % (2 * dims.cp):
        problems.append(
            f"cp = {dims.cp} needs [train] seq_len (now {train.seq_len}) divisible by 2 * cp = {2 * dims.cp}: "
            "each sequence is cut into 2 * cp equal chunks, two per context-parallel rank"
        )
    refused = [
        (dims.tp > 1, f"tp = {dims.tp}", "set tp = 1"),
        (dims.pp > 1, f"pp = {dims.pp}", "set pp = 1"),
        (dims.ep > 1, f"ep = {dims.ep}", "set ep = 1"),
        (dims.dp_replicate > 1, f"dp_replicate = {dims.dp_replicate}", "shard instead (dp_shard)"),
        (train.compile, "[train] compile = true", "set compile = false"),
    ]
    for active, what, fix in refused:
        if active:
            problems.append(f"context parallelism (cp = {dims.cp}) is not supported with {what} yet; {fix} or cp = 1")
    return problems
