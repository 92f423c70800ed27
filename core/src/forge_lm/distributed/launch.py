"""Find out how the process was launched and join its process group.

``torchrun`` (also under SLURM: ``srun torchrun ...``) sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. A plain ``srun`` launch of one task per
rank sets only SLURM's variables; they are translated, and the rendezvous address must then
come from ``MASTER_ADDR``/``MASTER_PORT`` (the scripts in ``examples/slurm`` export them).
A process with neither is a single-process run and joins no group, unless it needs one of its
own (:func:`init_one_rank_group`: FSDP2's ``cpu_offload`` on one GPU).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

import attrs
import torch
import torch.distributed as dist

from forge_lm.errors import ConfigError, ForgeError

T = TypeVar("T")


@attrs.frozen
class Launch:
    """This process's place in the launch."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "single"  # "torchrun", "slurm" or "single"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect_launch(environ: Mapping[str, str] | None = None) -> Launch:
    """The launch described by the environment (``os.environ`` by default)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launch = Launch(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK", default=0),
            launcher="torchrun",
        )
        _check_one_node(launch, env)
        return launch
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", default=1) > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise ConfigError(
                    f"launched by srun with {env['SLURM_NTASKS']} tasks but {name} is not set; export "
                    "MASTER_ADDR (the first node) and MASTER_PORT in the job script, or launch with "
                    "'srun torchrun ...' (see examples/slurm)."
                )
        return Launch(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID", default=0),
            launcher="slurm",
        )
    return Launch()


def _check_one_node(launch: Launch, env: Mapping[str, str]) -> None:
    """torchrun also says how many processes it started on this node (``LOCAL_WORLD_SIZE``) and
    on how many nodes (``GROUP_WORLD_SIZE``). On one node the two counts must agree with
    ``WORLD_SIZE``, and a disagreement is known at once, without waiting for ranks that will
    never come. (Across nodes the per-node counts may differ: only the rendezvous can tell.)"""
    if env.get("GROUP_WORLD_SIZE") != "1" or "LOCAL_WORLD_SIZE" not in env:
        return
    started = _int(env, "LOCAL_WORLD_SIZE")
    if started != launch.world_size:
        raise ConfigError(
            f"WORLD_SIZE={launch.world_size} claims {launch.world_size} ranks, but torchrun started {started} "
            f"processes on its one node (LOCAL_WORLD_SIZE={started}, GROUP_WORLD_SIZE=1): the run would wait for "
            "ranks that never come. Do not set WORLD_SIZE yourself; let torchrun's --nproc_per_node and --nnodes "
            "decide it."
        )


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in env:
        if default is None:
            raise ConfigError(f"the launch environment lacks {name}")
        return default
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"the launch environment has {name}={env[name]!r}, which is not an integer") from None


def rank_device(device: torch.device, launch: Launch) -> torch.device:
    """The device of this rank: on CUDA, the GPU of its local rank (one GPU per process).

    A process that sees exactly one GPU uses it, whatever its local rank: that is how SLURM's
    ``--gpus-per-task=1`` (and CUDA_VISIBLE_DEVICES set per task) hands each task its GPU, as
    ``cuda:0`` of the task. With several visible GPUs, local rank ``i`` takes ``cuda:i``."""
    if device.type == "cuda" and launch.distributed:
        visible = torch.cuda.device_count()
        index = 0 if visible == 1 else launch.local_rank
        if device.index is not None and device.index != index:
            raise ConfigError(
                f"[train] device: '{device}' names one GPU, but a distributed run uses the GPU of each "
                "rank's LOCAL_RANK; set device = 'cuda' or 'auto'."
            )
        if index >= visible:
            raise ConfigError(
                f"local rank {launch.local_rank} has no GPU: this process sees {visible}; launch at most that "
                "many processes per node (--nproc_per_node), or give each task its own GPU (--gpus-per-task=1)."
            )
        return torch.device("cuda", index)
    return device


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors (gloo beside it for the few CPU collectives); gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


class LaunchIncomplete(ForgeError):
    """Not every rank the launch environment claims joined the process group in time: the
    environment claims more ranks than were started, or some failed or cannot reach the first."""


def _claimed(launch: Launch) -> str:
    return f"WORLD_SIZE={launch.world_size}" if launch.launcher == "torchrun" else f"SLURM_NTASKS={launch.world_size}"


def _address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _waiting(launch: Launch, timeout_s: float) -> None:
    """Said while the rendezvous waits (a slow start of other nodes is normal; a launch that
    claims more ranks than it started is not): what is expected, and for how long."""
    claimed = _claimed(launch)
    print(
        f"forge: rank {launch.rank} is waiting for the run's {launch.world_size} ranks (0-{launch.world_size - 1}, "
        f"{claimed} from {launch.launcher}) to join at {_address()}; it gives up after [distributed] timeout = "
        f"{timeout_s:g} s. If fewer processes were started, stop it and make {claimed.partition('=')[0]} the "
        "number of processes started.",
        file=sys.stderr,
        flush=True,
    )


def _notice_after(timeout_s: float) -> float:
    """Seconds of waiting before :func:`_waiting` speaks: a normal start is quiet."""
    return min(10.0, timeout_s / 4)


def _incomplete(launch: Launch, timeout_s: float, error: BaseException) -> str:
    claimed, where = _claimed(launch), _address()
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (
        f"rank {launch.rank} could not join the run's {launch.world_size} ranks ({claimed}, from {launch.launcher}) "
        f"at {where} within [distributed] timeout = {timeout_s:g} s: {first_line} Check that {claimed} is the "
        "number of processes started (torchrun's --nnodes and --nproc_per_node, srun's --ntasks), that every "
        "node reaches MASTER_ADDR:MASTER_PORT, and that no rank failed at start (its output says why). Nothing "
        "was written."
    )


_OWNED_GROUP = False  # whether init_distributed created the default process group
JOINED = False  # whether this process ever joined a process group (see exit_process)


def init_distributed(launch: Launch, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the launch's process group (once); a no-op for a single process, or when the caller
    has already initialised one (then :func:`shutdown_distributed` leaves it alone too)."""
    global _OWNED_GROUP, JOINED
    if not launch.distributed or dist.is_initialized():
        return
    if launch.launcher == "slurm":  # env:// reads these
        os.environ.setdefault("RANK", str(launch.rank))
        os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
        os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    notice = threading.Timer(_notice_after(timeout_s), _waiting, args=(launch, timeout_s))
    notice.daemon = True
    notice.start()
    try:
        dist.init_process_group(
            backend=backend_for(device),
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    except dist.DistError as exc:  # the store's "Timed out after N seconds waiting for clients. 1/4 clients joined."
        raise LaunchIncomplete(_incomplete(launch, timeout_s, exc)) from None
    finally:
        notice.cancel()
    _OWNED_GROUP = True
    JOINED = True


def init_one_rank_group(device: torch.device, timeout_s: float = 600.0) -> None:
    """A process group of this process alone, for a one-process run that needs one: FSDP2 shards
    over a device mesh, and ``[distributed] cpu_offload`` in one process is FSDP2 over a mesh of
    one rank (as torchtitan runs it on one GPU). Its rendezvous is an in-memory store, so it
    needs no address or port. A no-op when a group exists already (the caller's, which
    :func:`shutdown_distributed` then leaves alone); the group made here is destroyed by it."""
    global _OWNED_GROUP, JOINED
    if dist.is_initialized():
        return
    if device.type == "cuda":  # NCCL binds the group to one GPU: "cuda" alone means the current one
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend_for(device),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    _OWNED_GROUP = True
    JOINED = True


def shutdown_distributed(wait_for_all: bool = False, release: Callable[[], None] | None = None) -> None:
    """Leave the process group :func:`init_distributed` created, if it did, in this order:

    1. ``wait_for_all``: wait until every rank is here, so that no rank tears down its
       connections while another still finishes a transfer to it (the last pipeline sends are
       asynchronous). Only for stops every rank makes together: a rank failing alone would
       wait for ranks that never come.
    2. ``release``: drop what holds a subgroup or its transfers (the pipeline's stages and
       schedules), so that nothing keeps a group object alive past step 3: one still
       referenced is destroyed later, in the interpreter's finalization, where torch can
       abort ("terminate called without an active exception").
    3. destroy the process group.

    The group is destroyed exactly once: a second call (or a call in a process that did not
    create it) only runs ``release``. Steps 2 and 3 run even when the barrier fails (a rank
    that died), and its error is raised after them.
    """
    global _OWNED_GROUP
    owned, _OWNED_GROUP = _OWNED_GROUP and dist.is_initialized(), False  # cleared first: once, whatever fails
    try:
        if owned and wait_for_all:
            dist.barrier()
    finally:
        try:
            if release is not None:
                release()
        finally:
            if owned:
                dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a process that has left its process group, with ``code``, skipping the interpreter's
    finalization: torch's gloo backend can abort in its C++ destructors at exit ("terminate
    called without an active exception", exit -6) after every result is written, turning a
    finished run into a crash. Output is flushed first; nothing else is pending by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_main_process() -> bool:
    """Rank 0 of the world, or the only process: the one that writes shared files and metrics."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def on_main_process(action: Callable[[], T]) -> T:
    """Run ``action`` on rank 0 only and hand its result (or its ForgeError) to every rank, so
    that one rank's failure stops all of them instead of leaving them waiting."""
    if not (dist.is_available() and dist.is_initialized()):
        return action()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", action())
        except ForgeError as exc:
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
