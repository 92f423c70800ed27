"""``[distributed] cpu_offload`` in one process (one GPU, ZeRO-Offload's user): FSDP2 over a mesh
of one rank, in a process group Forge makes for it, the CPU standing in for the GPU (the refusal
on a CPU device is lifted where the run's build imports it). Four short runs in this process:
offloaded, plain (no offload: no FSDP2 at all), and the offloaded run stopped at step 2 then
resumed from its checkpoint. Then the wiring a CPU cannot run: the group made for CUDA, the
buffers left on the device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext, fsdp, launch
from forge_lm.distributed.offload import buffers_to, check_offload, fsdp_in_one_process, parameters_device
from forge_lm.errors import ConfigError
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import metrics_by_step
from forge_lm.train import parts as parts_module
from forge_lm.train import train

from .workers.offload_worker import BASE as TWO_RANK_BASE
from .workers.offload_worker import _Watch

CUDA = torch.device("cuda", 0)  # a device object only, except where CUDA's calls are replaced
BASE = [option for option in TWO_RANK_BASE if not option.startswith("--distributed.dp_shard")]  # one process


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("offload-one-process")
    watch = _Watch()
    manager = PluginManager(PluginSettings(autoload=False))
    manager.add_plugin(watch, "offload-watch")
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parts_module, "check_offload", lambda *args: None)  # the CPU stands in for the GPU
        patch.setattr(launch, "JOINED", launch.JOINED)  # restored: this test process joined no real launch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for name, directory, extra in (
                ("offloaded", "offloaded", ["--distributed.cpu_offload=true"]),
                ("plain", "plain", []),
                ("first_half", "resumed", ["--distributed.cpu_offload=true", "--train.max_steps=2"]),
                ("resumed", "resumed", ["--distributed.cpu_offload=true"]),
            ):
                watch.seen = {}
                config = load_config(None, [*BASE, *extra, f"--train.output_dir={work / directory}"], manager.registry)
                train(config, manager)
                losses = {step: m["loss"] for step, m in metrics_by_step(work / directory).items() if "loss" in m}
                results[name] = {"losses": losses, "seen": watch.seen, "group_left": dist.is_initialized()}
        finally:
            torch.set_num_threads(threads)
    return results


def test_fsdp2_runs_over_one_rank_with_everything_offloaded(runs: dict) -> None:
    seen = runs["offloaded"]["seen"]
    assert seen["status"] == "completed"
    assert seen["units"] == 3  # two blocks and the root
    assert seen["mesh_sizes"] == [1]
    assert seen["offloaded"] == [True]
    assert seen["shard_devices"] == ["cpu"]
    assert seen["optimizer_devices"] == ["cpu"]
    assert seen["group_size"] == 1  # the group Forge made for it ...
    assert not runs["offloaded"]["group_left"]  # ... and left at the run's end
    plain = runs["plain"]["seen"]
    assert plain["units"] == 0  # without offloading one process runs no FSDP2, and joins no group
    assert plain["group_size"] is None


def test_the_losses_are_those_of_the_plain_one_process_run(runs: dict) -> None:
    offloaded, plain = runs["offloaded"]["losses"], runs["plain"]["losses"]
    assert list(offloaded) == [1, 2, 3]
    assert offloaded == plain  # bitwise: the same arithmetic, the weights kept elsewhere


def test_a_run_resumed_from_an_offloaded_checkpoint_goes_on_exactly(runs: dict) -> None:
    assert list(runs["first_half"]["losses"]) == [1, 2]
    assert runs["resumed"]["seen"]["status"] == "completed"
    assert runs["resumed"]["losses"] == runs["offloaded"]["losses"]


def config_of(manager, *overrides: str):
    return load_config(None, [*TINY_MODEL, "--train.seq_len=16", "--train.batch_size=2", *overrides], manager.registry)


def test_one_gpu_is_accepted_and_only_a_layout_without_fsdp2_units_is_refused(manager):
    offload = config_of(manager, "--distributed.cpu_offload=true")
    check_offload(offload, CUDA, ParallelDims())  # one process on a GPU: FSDP2 over one rank
    assert fsdp_in_one_process(offload, ParallelDims())
    assert not fsdp_in_one_process(offload, ParallelDims(dp_shard=2))  # torchrun's ranks: its own mesh
    assert not fsdp_in_one_process(config_of(manager), ParallelDims())
    with pytest.raises(ConfigError, match=r"1 of 2 ranks\): set dp_shard >= 2"):
        check_offload(offload, CUDA, ParallelDims(dp_shard=1, tp=2))


def test_the_fsdp2_transform_is_on_in_one_process_only_with_cpu_offload_and_a_mesh(manager):
    offload, plain = config_of(manager, "--distributed.cpu_offload=true"), config_of(manager)
    one_rank_mesh = object()  # what the run builds for it (ParallelDims.build_mesh(one_rank=True))
    transform = fsdp.fsdp2_transform(None)
    assert transform.enabled(TransformContext(offload, ParallelDims(), one_rank_mesh, CUDA, None))
    assert not transform.enabled(TransformContext(offload, ParallelDims(), None, CUDA, None))
    assert not transform.enabled(TransformContext(plain, ParallelDims(), one_rank_mesh, CUDA, None))


def test_the_one_rank_group_for_a_gpu_binds_nccl_to_it_beside_gloo(monkeypatch):
    made: list[dict] = []
    bound: list[torch.device] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(made))
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: made.append(kwargs))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(launch, "_OWNED_GROUP", False)
    monkeypatch.setattr(launch, "JOINED", False)

    launch.init_one_rank_group(torch.device("cuda"), timeout_s=30)  # "cuda": the current GPU
    launch.init_one_rank_group(torch.device("cuda"), timeout_s=30)  # a group exists: nothing more

    assert len(made) == 1
    group = made[0]
    assert (group["backend"], group["rank"], group["world_size"]) == ("cpu:gloo,cuda:nccl", 0, 1)
    assert group["device_id"] == bound[0] == CUDA
    assert isinstance(group["store"], dist.HashStore)  # no address, no port
    assert group["timeout"].total_seconds() == 30
    assert launch._OWNED_GROUP  # shutdown_distributed destroys it


def test_offloaded_parameters_are_made_on_the_host_and_buffers_go_to_the_device(manager):
    """``meta`` stands in for the GPU the buffers go to: the parameters stay where they are."""
    offload = config_of(manager, "--distributed.cpu_offload=true")
    assert parameters_device(offload, CUDA) == torch.device("cpu")
    assert parameters_device(config_of(manager), CUDA) == CUDA
    model = build_model(offload.model, 257, manager.registry)
    model.register_buffer("shared", torch.ones(3))
    model.blocks()[0].register_buffer("shared", model.shared)  # one tensor in two modules
    buffers = dict(model.named_buffers(remove_duplicate=False))
    assert len(buffers) > 1

    buffers_to(model, torch.device("meta"))

    assert {str(b.device) for b in model.buffers()} == {"meta"}
    assert model.blocks()[0].shared is model.shared  # still one tensor
    assert {str(p.device) for p in model.parameters()} == {"cpu"}
