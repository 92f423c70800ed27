"""MFU: peak FLOP/s from the config, a table of GPUs, or a CPU measurement cached on disk."""

from __future__ import annotations

import json
import math

import pytest
import torch

from forge_lm.errors import ConfigError
from forge_lm.metrics import mfu as mfu_module
from forge_lm.metrics.mfu import cache_path, cpu_cache_key, measure_cpu_flops, mfu, peak_flops, world_peak_flops


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def measurements(monkeypatch):
    """Replace the CPU measurement by a counter returning 1e11, 2e11, ... on successive calls."""
    calls = []

    def fake_measure(dtype=torch.float32):
        calls.append(dtype)
        return 1e11 * len(calls)

    monkeypatch.setattr(mfu_module, "measure_cpu_flops", fake_measure)
    return calls


def gpu_named(monkeypatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_mfu_is_achieved_flops_over_peak():
    # A 124M-parameter model at 6 N flops per token, 50,000 tokens/s on a 312 TFLOP/s A100.
    flops_per_token = 6 * 124e6

    assert mfu(flops_per_token, 50_000, 312e12) == pytest.approx(744e6 * 5e4 / 3.12e14)
    assert mfu(flops_per_token, 50_000, 312e12) == pytest.approx(0.11923, rel=1e-4)


def test_mfu_refuses_a_peak_that_is_not_positive():
    with pytest.raises(ValueError, match="peak FLOP/s must be > 0"):
        mfu(1e9, 1e3, 0.0)


def test_a_configured_peak_wins_over_table_and_measurement(monkeypatch, measurements):
    gpu_named(monkeypatch, "NVIDIA H100 80GB HBM3")

    assert peak_flops("cuda", torch.bfloat16, configured=1.5e14) == 1.5e14
    assert peak_flops("cpu", torch.float32, configured=2e11) == 2e11
    assert measurements == []


# Dense peaks from the datasheets: the sheets' "with sparsity" tensor rates halved.
@pytest.mark.parametrize(
    ("device_name", "bf16", "fp32"),
    [
        ("NVIDIA H100 80GB HBM3", 1979e12 / 2, 66.9e12),  # SXM5
        ("NVIDIA H100 PCIe", 1513e12 / 2, 51.2e12),
        ("NVIDIA H100 NVL", 1671e12 / 2, 60e12),
        ("NVIDIA H200", 1979e12 / 2, 66.9e12),
        ("NVIDIA A100-SXM4-80GB", 624e12 / 2, 19.5e12),
        ("NVIDIA A100 80GB PCIe", 624e12 / 2, 19.5e12),
        ("NVIDIA L40S", 733e12 / 2, 91.6e12),
        ("NVIDIA L40", 362e12 / 2, 90.5e12),
        ("NVIDIA L4", 242e12 / 2, 30.3e12),
        ("NVIDIA A10", 250e12 / 2, 31.2e12),
        ("NVIDIA GeForce RTX 4090", 330.4e12 / 2, 82.6e12),
    ],
)
def test_known_gpus_get_their_dense_datasheet_peak(monkeypatch, device_name, bf16, fp32):
    gpu_named(monkeypatch, device_name)

    assert peak_flops("cuda", torch.bfloat16) == pytest.approx(bf16, rel=2e-3)
    assert peak_flops(torch.device("cuda", 0), torch.float32) == pytest.approx(fp32, rel=2e-3)


@pytest.mark.parametrize("device_name", ["NVIDIA A10G", "Some Future GPU 9000"])
def test_an_unknown_gpu_asks_for_metrics_peak_flops(monkeypatch, device_name):
    gpu_named(monkeypatch, device_name)

    with pytest.raises(ConfigError, match=rf"GPU '{device_name}' is not in .* set \[metrics\] peak_flops"):
        peak_flops("cuda", torch.bfloat16)


@pytest.mark.parametrize(
    "device_name", ["NVIDIA GB200", "NVIDIA H800", "AMD Instinct MI300X", "NVIDIA A10G", "Tesla V100"]
)
def test_a_device_without_a_known_peak_warns_once_and_logs_no_mfu(monkeypatch, capsys, device_name):
    dtype = torch.bfloat16  # V100 is in the table, without a bf16 peak
    gpu_named(monkeypatch, device_name)
    assert world_peak_flops("cuda", dtype, None, world_size=8) is None
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith("forge: warning: MFU will not be logged: ")
    assert "set [metrics] peak_flops" in warning
    assert world_peak_flops("cuda", dtype, 1e15, world_size=8) == 8e15  # the configured peak still sets it


def test_an_unknown_gpu_trains_and_logs_everything_but_mfu(monkeypatch, manager, tmp_path):
    """The run itself, its peak looked up for a GPU the table lacks: the lookup no longer stops it."""
    import forge_lm.train.loop as loop
    from forge_lm.config import load_config
    from forge_lm.metrics.jsonl import read_metrics
    from forge_lm.train import train

    monkeypatch.setattr(loop, "world_peak_flops", lambda *args: world_peak_flops("cuda", torch.bfloat16, None, 1))
    gpu_named(monkeypatch, "NVIDIA B300")
    tiny = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=4", "--model.max_seq_len=32"]
    tiny += ["--train.batch_size=2", "--train.seq_len=16", "--train.max_steps=2", "--data.name=synthetic"]
    tiny += ['--metrics.backends=["jsonl"]', "--metrics.log_interval=1", "--eval.interval=0"]
    config = load_config(None, [*tiny, f"--train.output_dir={tmp_path / 'run'}"], manager.registry)
    train(config, manager)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all("loss" in r and "tokens_per_sec" in r and "mfu" not in r for r in records)


def test_no_autocast_dtype_means_the_fp32_peak(monkeypatch):
    gpu_named(monkeypatch, "NVIDIA A100-SXM4-40GB")

    assert peak_flops("cuda", None) == peak_flops("cuda", torch.float32) == 19.5e12


def test_a_gpu_without_bf16_asks_for_metrics_peak_flops(monkeypatch):
    gpu_named(monkeypatch, "Tesla V100-SXM2-16GB")

    assert peak_flops("cuda", torch.float32) == 15.7e12
    with pytest.raises(ConfigError, match=r"NVIDIA V100 has no bf16 peak .* set \[metrics\] peak_flops"):
        peak_flops("cuda", torch.bfloat16)


def test_a_dtype_without_a_peak_asks_for_metrics_peak_flops():
    with pytest.raises(ConfigError, match=r"no known peak for dtype torch.float64; set \[metrics\] peak_flops"):
        peak_flops("cpu", torch.float64)


def test_cpu_peak_is_measured_once_then_read_from_the_cache(cache_home, measurements):
    first = peak_flops("cpu", torch.float32)
    second = peak_flops("cpu", torch.float32)

    assert first == second == 1e11
    assert measurements == [torch.float32]
    stored = json.loads((cache_home / "forge_lm" / "peak_flops.json").read_text())
    assert stored == {cpu_cache_key(torch.float32): 1e11}


def test_cpu_cache_key_names_the_cpu_threads_torch_and_dtype(monkeypatch):
    monkeypatch.setattr(mfu_module, "cpu_model", lambda: "Example CPU @ 3.0GHz")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)

    assert cpu_cache_key(torch.bfloat16) == f"Example CPU @ 3.0GHz | threads=6 | torch={torch.__version__} | bf16"


def test_a_different_thread_count_is_measured_anew_and_both_are_kept(cache_home, measurements, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    two = peak_flops("cpu", torch.float32)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    eight = peak_flops("cpu", torch.float32)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    two_again = peak_flops("cpu", torch.float32)

    assert (two, eight, two_again) == (1e11, 2e11, 1e11)
    assert len(measurements) == 2
    assert len(json.loads(cache_path().read_text())) == 2


def test_a_damaged_cache_is_measured_again_and_rewritten(cache_home, measurements):
    path = cache_home / "forge_lm" / "peak_flops.json"
    path.parent.mkdir()
    path.write_text("{not json")

    assert peak_flops("cpu", torch.float32) == 1e11
    assert json.loads(path.read_text()) == {cpu_cache_key(torch.float32): 1e11}


def test_an_unwritable_cache_still_gives_the_measured_peak(tmp_path, measurements, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where the cache folder should be

    assert peak_flops("cpu", torch.float32) == 1e11


def test_cache_defaults_to_dot_cache_in_home(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))

    assert cache_path() == tmp_path / ".cache" / "forge_lm" / "peak_flops.json"


def test_the_measurement_times_square_matmuls_of_the_size_it_chose(monkeypatch):
    # Clock and matmul replaced: each mm of size n "takes" 2 n^3 / 1e10 seconds, so the
    # measured rate must be exactly 1e10 FLOP/s, and the timed size the one for ~0.2 s.
    now = [0.0]
    sizes = []

    def fake_mm(a, b):
        sizes.append(a.shape[0])
        now[0] += 2 * a.shape[0] ** 3 / 1e10
        return a

    monkeypatch.setattr(mfu_module.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(mfu_module.torch, "mm", fake_mm)

    rate = measure_cpu_flops(torch.float32)

    timed = sizes[-1]
    assert rate == pytest.approx(1e10)
    assert timed % 64 == 0
    assert 2 * timed**3 / 1e10 == pytest.approx(0.2, rel=0.2)  # about 0.2 s per matmul


def test_the_real_measurement_is_a_positive_finite_rate():
    rate = measure_cpu_flops(torch.float32)

    assert math.isfinite(rate)
    assert rate > 0
