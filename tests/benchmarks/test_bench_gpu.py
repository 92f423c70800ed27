"""benchmarks/bench_gpu.py on a CPU: the smoke run brings its numbers home under --output, the
sides of a model are freed one before the next is built, the plain MoE baseline computes what
forge-moe's layer computes, and without CUDA the real run refuses."""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch

from forge_lm.metrics.gpu_peaks import gpu_peak_flops
from forge_lm.plugins import PluginSettings

from .conftest import BENCHMARKS, REPO

SCRIPT = BENCHMARKS / "bench_gpu.py"
RESULTS = [BENCHMARKS / "results" / "gpu.json", BENCHMARKS / "RESULTS.md"]
HAS_MOE = importlib.util.find_spec("forge_moe") is not None
needs_moe = pytest.mark.skipif(not HAS_MOE, reason="the forge-moe plugin is not installed")


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
        cwd=REPO,
    )


def snapshot() -> list[bytes | None]:
    return [path.read_bytes() if path.exists() else None for path in RESULTS]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One ``--smoke --output DIR`` run shared by the tests below: its process, record and table."""
    out = tmp_path_factory.mktemp("bench-gpu")
    before = snapshot()
    done = run_script("--smoke", "--output", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {
        "done": done,
        "record": json.loads((out / "gpu.json").read_text()),
        "table": (out / "gpu.md").read_text(),
        "results_unchanged": snapshot() == before,
    }


def test_the_smoke_run_writes_json_and_table_with_one_row_per_side(smoke):
    rows = smoke["record"]["rows"]

    sides = [(row["model"], row["side"]) for row in rows]
    dense = ["forge", "plain", "plain causal", "forge fp16", "forge activation_offload", "forge cpu_offload"]
    expected = [("dense (smoke)", side) for side in dense]
    if HAS_MOE:
        expected += [("MoE (smoke)", "forge"), ("MoE (smoke)", "plain")]
    assert sides == expected
    measured = [row for row in rows if "skipped" not in row]
    for row in rows:
        assert f"| {row['model']} | {row['side']} | " in smoke["table"]
    for row in measured:
        assert row["tokens_per_s"] > 0
        assert row["steps_per_s"] == pytest.approx(row["tokens_per_s"] / row["tokens_per_step"], rel=1e-12)
        assert "peak_memory_gib" in row
        assert row["peak_memory_gib"] is None  # measured on CUDA only
        assert "error" not in row
    assert smoke["record"]["benchmark"] == "gpu"
    assert smoke["record"]["command"] == f"python benchmarks/bench_gpu.py --smoke --output {smoke['done'].args[-1]}"


def test_the_smoke_run_records_nothing_in_results(smoke):
    assert smoke["results_unchanged"]
    assert smoke["done"].stdout.rstrip().endswith("not recorded in results/ (--smoke)")


def test_forge_and_plain_start_from_the_same_weights_and_batch(smoke):
    """Equal first-step losses: the same work on both sides (for MoE: the plain router and
    grouped-GEMM experts compute forge-moe's layer), near ln(512) for a fresh 512-token model."""
    by_side = {(row["model"], row["side"]): row.get("first_step_loss") for row in smoke["record"]["rows"]}
    for model in ("dense (smoke)", "MoE (smoke)") if HAS_MOE else ("dense (smoke)",):
        assert by_side[(model, "plain")] == pytest.approx(by_side[(model, "forge")], rel=1e-3)
        assert by_side[(model, "forge")] == pytest.approx(math.log(512), abs=0.3)
    # fp16 autocast with the loss scale: the bf16 side's first loss, within the two formats' rounding
    assert by_side[("dense (smoke)", "forge fp16")] == pytest.approx(by_side[("dense (smoke)", "forge")], rel=1e-3)


def test_on_the_cpu_the_offload_rows_say_forge_refuses_them_and_fp16_is_measured(smoke):
    rows = {row["side"]: row for row in smoke["record"]["rows"] if row["model"] == "dense (smoke)"}
    assert rows["forge fp16"]["tokens_per_s"] > 0
    for side, setting in (("forge activation_offload", "[train]"), ("forge cpu_offload", "[distributed]")):
        row = rows[side]
        assert row["tokens_per_s"] is None
        assert row["skipped"].startswith(f"{setting} {side.split()[1]} = true moves memory from a GPU to the host, ")
        assert "there is nothing to offload to" in row["skipped"]
        assert f"  {side}: skipped: " in smoke["done"].stdout


def test_on_one_gpu_every_precision_and_memory_side_is_built(bench, monkeypatch, tmp_path):
    """Which sides a real run builds, with CUDA stood in for (nothing is built on it): cpu_offload
    too, FSDP2 over a mesh of this one process's rank."""
    gpu = bench("bench_gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    overrides = ["--train.device=cuda", *gpu.SMOKE, "--metrics.peak_flops=1e12"]

    builders, skipped = gpu.variant_builders("d", overrides, PluginSettings.from_env(), tmp_path)

    assert skipped == {}
    assert list(builders) == ["forge fp16", "forge activation_offload", "forge cpu_offload"]
    assert [b.args[0][-1] for b in builders.values()] == [
        "--train.precision=fp16",
        "--train.activation_offload=true",
        "--distributed.cpu_offload=true",
    ]


def test_the_cpu_offload_side_steps_as_fsdp2_over_one_rank(bench, monkeypatch, tmp_path):
    """The side a GPU run builds for cpu_offload, built and stepped with the CPU standing in for the
    GPU (the refusal lifted): FSDP2 units holding offloaded shards, no plain copy of the model, the
    first loss that of the forge side, and no process group left once the script leaves it."""
    import torch.distributed as dist

    from forge_lm.distributed import launch
    from forge_lm.train import parts

    gpu = bench("bench_gpu")
    monkeypatch.setattr(parts, "check_offload", lambda *args: None)
    monkeypatch.setattr(launch, "JOINED", launch.JOINED)  # restored: this test process joined no real launch
    # fp32: under bf16, FSDP2's mixed precision computes norms and the embedding in bf16 too (autocast does not)
    overrides = ["--train.device=cpu", *gpu.SMOKE, "--train.precision=fp32", "--metrics.peak_flops=1e12"]
    settings = PluginSettings.from_env()
    try:
        side = gpu._forge_side([*overrides, "--distributed.cpu_offload=true"], tmp_path / "offload", settings)
        side.run(1)
        states = [m._get_fsdp_state() for m in side.model.modules() if hasattr(m, "_get_fsdp_state")]
        params = [p for s in states if s._fsdp_param_group for p in s._fsdp_param_group.fsdp_params]
        assert len(states) == 3  # two blocks and the root
        assert {p.offload_to_cpu for p in params} == {True}
        assert {p.mesh_info.mesh.size() for p in params} == {1}
        assert side.initial_model is None
        offloaded_loss = side.first[0]
        side.close()
    finally:
        gpu.shutdown_distributed()  # what main() does after the dense model's sides
    assert not dist.is_initialized()
    plain = gpu._forge_side(overrides, tmp_path / "plain", settings)
    plain.run(1)
    assert offloaded_loss == plain.first[0]  # the same weights, batch and arithmetic


def test_the_smoke_run_takes_mfu_from_the_gpu_peak_table(smoke):
    """MFU = (6 N_active + 12 L d T) x tokens/s over the H200's bf16 entry of Forge's table."""
    peak = gpu_peak_flops("NVIDIA H200", "bf16")
    for row in (r for r in smoke["record"]["rows"] if "skipped" not in r):  # a skipped side has no numbers
        flops_per_token = 6 * row["active_params_b"] * 1e9 + 12 * 2 * 64 * 64  # 2 layers, dim 64, seq 64
        assert row["mfu_table_peak"] == pytest.approx(flops_per_token * row["tokens_per_s"] / peak, rel=1e-6)
    assert "989 TFLOP/s (GPU table: NVIDIA H200 SXM bf16" in smoke["record"]["notes"]


def test_the_smoke_run_trains_in_bf16_with_grouped_gemm_experts(smoke):
    assert "--train.precision=bf16" in smoke["record"]["notes"]
    assert "--model.ffn.expert_kernel=grouped_mm" in smoke["record"]["notes"]  # forge-moe's side: forced


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run")
def test_without_cuda_the_real_run_refuses_and_records_nothing(tmp_path):
    before = snapshot()

    done = run_script("--output", str(tmp_path / "out"))

    assert done.returncode == 2
    assert done.stderr.startswith("bench_gpu.py: skipped: CUDA is not available")
    assert "use --smoke to check the script on the CPU" in done.stderr
    assert snapshot() == before
    assert not (tmp_path / "out").exists()


@needs_moe
def test_each_side_is_freed_before_the_next_is_built(bench, tmp_path):
    """The real sides of both models: when a side is built, no earlier side's model or optimizer
    is alive (one GPU cannot hold the MoE model's sides together)."""
    gpu, common = bench("bench_gpu"), bench("_gpu_common")
    settings = PluginSettings.from_env()
    base = ["--train.device=cpu", *gpu.SMOKE, "--metrics.peak_flops=1e12"]
    refs: list[weakref.ref] = []
    leaks: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only waits on a busy machine
    gc.disable()  # Forge's model sits in reference cycles: only the loop's own collection may free it

    def watched(name, build):
        def build_watched():
            leaks.extend(f"{ref} alive when {name} was built" for ref in refs if ref() is not None)
            side = build()
            refs.extend([weakref.ref(side.model), weakref.ref(side.optimizer)])
            return side

        return build_watched

    try:
        for tag, overrides, moe in (("d", base, False), ("m", [*base, *gpu.MOE], True)):
            builders = gpu.side_builders(tag, overrides, settings, tmp_path, moe=moe, compile_side=False)
            watched_builders = {name: watched(f"{tag} {name}", build) for name, build in builders.items()}
            common.measure_in_turn(watched_builders, rounds=1, warmup=0, steps=1, device=torch.device("cpu"))
    finally:
        gc.enable()
        torch.set_num_threads(threads)

    assert len(refs) == 2 * 5  # dense forge, plain, plain causal; MoE forge, plain
    assert leaks == []
    assert [ref() for ref in refs] == [None] * len(refs)


@needs_moe
@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
def test_plain_moe_matches_the_forge_moe_layer(bench, kernel, monkeypatch):
    """Outputs and every gradient of the plain baseline equal forge-moe's layer on the same weights;
    with ``grouped_mm`` its experts run as three ``torch._grouped_mm`` calls."""
    from forge_moe.layer import MoELayer
    from forge_moe.routers import SoftmaxTopKRouter

    gpu = bench("bench_gpu")
    torch.manual_seed(0)
    layer = MoELayer(16, 0, SoftmaxTopKRouter(16, 4, 2), n_experts=4, top_k=2, expert_hidden=24, kernel="loop")
    model = torch.nn.Sequential(layer)
    reference = torch.nn.Sequential(MoELayer(16, 0, SoftmaxTopKRouter(16, 4, 2), n_experts=4, top_k=2,
                                             expert_hidden=24, kernel="loop"))  # fmt: skip
    reference.load_state_dict(model.state_dict())
    assert gpu.use_plain_moe(model, kernel) == 1
    assert isinstance(model[0], gpu.PlainMoE)
    x = torch.randn(3, 5, 16, dtype=torch.float64).float()
    grad_out = torch.randn(3, 5, 16)

    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))

    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [model(xs[0])]
    assert len(calls) == (3 if kernel == "grouped_mm" else 0)
    outs.append(reference(xs[1]))
    for out in outs:
        out.backward(grad_out)

    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)
    plain, ref = model[0], reference[0]
    pairs = [(plain.router, ref.router.weight), (plain.w1, ref.experts.w1), (plain.w3, ref.experts.w3),
             (plain.w2, ref.experts.w2)]  # fmt: skip
    for mine, theirs in pairs:
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


@needs_moe
def test_plain_moe_refuses_a_layer_it_does_not_implement(bench):
    from forge_moe.layer import MoELayer
    from forge_moe.routers import SigmoidTopKRouter, SoftmaxTopKRouter

    gpu = bench("bench_gpu")
    sigmoid = torch.nn.Sequential(MoELayer(8, 0, SigmoidTopKRouter(8, 4, 2), n_experts=4, top_k=2, expert_hidden=8))
    shared = torch.nn.Sequential(
        MoELayer(8, 0, SoftmaxTopKRouter(8, 4, 2), n_experts=4, top_k=2, expert_hidden=8, n_shared_experts=1)
    )

    with pytest.raises(ValueError, match="0: PlainMoE implements the renormalised softmax_topk router only"):
        gpu.use_plain_moe(sigmoid)
    with pytest.raises(ValueError, match="no shared experts and no capacity limit; leave both unset"):
        gpu.use_plain_moe(shared)
