"""MFU: peak FLOP/s from the config, a table of GPUs, a CPU's theoretical peak, or a CPU
measurement cached on disk when the machine was idle."""

from __future__ import annotations

import datetime
import json
import math

import pytest
import torch

from forge_lm import hardware
from forge_lm.errors import ConfigError
from forge_lm.metrics import cpu_peak, measured_peak
from forge_lm.metrics.cpu_peak import theoretical_cpu_peak
from forge_lm.metrics.measured_peak import (
    CpuMeasurement,
    cache_path,
    cpu_cache_key,
    measure_cpu_flops,
    remeasure_cpu_peak,
)
from forge_lm.metrics.mfu import (
    mfu,
    peak_flops,
    peak_with_source,
    world_peak_flops,
    world_peak_with_source,
)


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def load(monkeypatch):
    """The 1-minute load of the other processes, on a 2-CPU machine: idle (0.1) unless changed."""
    current = [0.1]
    monkeypatch.setattr(hardware, "machine_load", lambda: (current[0], 2))
    return current


@pytest.fixture
def measurements(monkeypatch, load):
    """A CPU without a theoretical peak, whose measurement returns 1e11, 2e11, ... on successive
    calls (4 threads, 7 matmuls of 2048^2), on an idle machine."""
    calls = []

    def fake_measure(dtype=torch.float32):
        calls.append(dtype)
        return CpuMeasurement(flops=1e11 * len(calls), size=2048, repeats=7, threads=4)

    monkeypatch.setattr(measured_peak, "measure_cpu", fake_measure)
    monkeypatch.setattr(cpu_peak, "theoretical_cpu_peak", lambda dtype: (None, "no cpufreq"))
    monkeypatch.setattr(measured_peak, "_BUSY_MEASUREMENTS", {})
    return calls


def entry(flops: float) -> dict:
    """A cache entry of the fake measurement, taken today."""
    today = datetime.date.today().isoformat()
    return {"flops": flops, "size": 2048, "repeats": 7, "threads": 4, "date": today}


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
    import forge_lm.train.parts as parts
    from forge_lm.config import load_config
    from forge_lm.metrics.jsonl import read_metrics
    from forge_lm.train import train

    monkeypatch.setattr(
        parts, "world_peak_with_source", lambda *args: world_peak_with_source("cuda", torch.bfloat16, None, 1)
    )
    gpu_named(monkeypatch, "NVIDIA B300")
    tiny = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=4", "--model.max_seq_len=32"]
    tiny += ["--train.batch_size=2", "--train.seq_len=16", "--train.max_steps=2", "--data.name=synthetic"]
    tiny += ['--metrics.backends=["jsonl"]', "--metrics.log_interval=1", "--eval.interval=0"]
    config = load_config(None, [*tiny, f"--train.output_dir={tmp_path / 'run'}"], manager.registry)
    train(config, manager)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all("loss" in r and "tokens_per_sec" in r and "mfu" not in r for r in records)


def test_an_mfu_above_1_against_a_measured_cpu_peak_measures_it_again_once(monkeypatch, manager, tmp_path, capsys):
    """A cached peak measured while the machine was busy is far too low: the first logged MFU
    above 1 makes rank 0 measure again, and the run logs MFU against the new peak from there."""
    import forge_lm.train.loop as loop
    import forge_lm.train.parts as parts
    from forge_lm.config import load_config
    from forge_lm.metrics.jsonl import read_metrics
    from forge_lm.train import train

    monkeypatch.setattr(parts, "world_peak_with_source", lambda *args: (1.0, "measured: a stale value"))
    calls = []

    def remeasure(dtype):
        calls.append(dtype)
        return 1e15, "measured: best of 7, cached"

    monkeypatch.setattr(loop, "remeasure_cpu_peak_with_source", remeasure)
    tiny = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=4", "--model.max_seq_len=32"]
    tiny += ["--train.batch_size=2", "--train.seq_len=16", "--train.max_steps=3", "--data.name=synthetic"]
    tiny += ['--metrics.backends=["jsonl"]', "--metrics.log_interval=1", "--eval.interval=0", "--train.device=cpu"]
    config = load_config(None, [*tiny, f"--train.output_dir={tmp_path / 'run'}"], manager.registry)
    train(config, manager)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert calls == [None]  # once, for fp32 (no autocast)
    assert all(0 < r["mfu"] < 1 for r in records)  # every logged value against the new peak
    from forge_lm.model import build_model
    from forge_lm.model.flops import active_parameter_count, flops_per_token

    model = build_model(config.model, 257, manager.registry)
    per_token = flops_per_token(config.model.options, active_parameter_count(model), config.train.seq_len)
    for r in records:  # the formula with the new peak: flops per token x tokens/s / peak
        assert r["mfu"] == pytest.approx(per_token * r["tokens_per_sec"] / 1e15, rel=1e-9)
    assert "was too low; measuring it again" in capsys.readouterr().err


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
    assert stored == {cpu_cache_key(torch.float32): entry(1e11)}


def test_cpu_cache_key_names_the_cpu_its_matrix_flags_threads_torch_and_dtype(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_model", lambda: "Example CPU @ 3.0GHz")
    monkeypatch.setattr(hardware, "matrix_flags", lambda: ["avx2", "fma", "avx512f", "avx512_bf16"])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)

    expected = (
        f"Example CPU @ 3.0GHz | avx2+fma+avx512f+avx512_bf16 | threads=6 | torch={torch.__version__} | bf16 "
        "| torch.mm+F.linear"
    )
    assert cpu_cache_key(torch.bfloat16) == expected
    # another host of the same name without AVX-512 (an AMD EPYC of another generation) has its own peak
    monkeypatch.setattr(hardware, "matrix_flags", lambda: ["avx2", "fma"])
    assert cpu_cache_key(torch.bfloat16) != expected
    # the kernels measured are part of the key: a peak cached before oneDNN joined is not reused
    assert cpu_cache_key(torch.float32).endswith("| fp32 | " + "+".join(measured_peak.matmul_kernels(torch.float32)))


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
    assert json.loads(path.read_text()) == {cpu_cache_key(torch.float32): entry(1e11)}


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

    monkeypatch.setattr(measured_peak.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(measured_peak, "matmul_kernels", lambda dtype: {"torch.mm": fake_mm})

    rate = measure_cpu_flops(torch.float32)

    timed = sizes[-1]
    assert rate == pytest.approx(1e10)
    assert timed % 64 == 0
    assert 2 * timed**3 / 1e10 == pytest.approx(0.2, rel=0.2)  # about 0.2 s per matmul


def test_the_peak_is_the_fastest_kernel_a_layer_can_take(monkeypatch):
    # Two fake kernels on a fake clock, one twice as fast: the peak is the faster one's rate,
    # since the model's layers take it (an MFU against the slower would exceed 1).
    now = [0.0]

    def kernel_at(rate):
        def product(a, b):
            now[0] += 2 * a.shape[0] ** 3 / rate
            return a

        return product

    monkeypatch.setattr(measured_peak.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(
        measured_peak, "matmul_kernels", lambda dtype: {"slow": kernel_at(1e10), "fast": kernel_at(2e10)}
    )

    assert measure_cpu_flops(torch.float32) == pytest.approx(2e10)


def test_fp32_measures_the_onednn_product_of_forge_linear_layers():
    from forge_lm.model.linear import onednn_available

    kernels = measured_peak.matmul_kernels(torch.float32)
    assert ("oneDNN linear" in kernels) == onednn_available()
    assert "oneDNN linear" not in measured_peak.matmul_kernels(torch.bfloat16)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    for product in kernels.values():  # every kernel computes the same product's FLOPs: a @ b (or b.T)
        out = product(a, b)
        assert out.shape == (64, 64)
        assert torch.allclose(out, a @ b, atol=1e-4) or torch.allclose(out, a @ b.T, atol=1e-4)


def test_the_real_measurement_is_a_positive_finite_rate():
    rate = measure_cpu_flops(torch.float32)

    assert math.isfinite(rate)
    assert rate > 0


# -- where the peak came from ---------------------------------------------------------------------


def test_each_peak_says_where_it_came_from(monkeypatch, cache_home, measurements):
    gpu_named(monkeypatch, "NVIDIA H100 80GB HBM3")

    assert peak_with_source("cuda", None, configured=3e14) == (3e14, "configured ([metrics] peak_flops)")
    assert peak_with_source("cuda", torch.bfloat16) == (989.4e12, "GPU table: NVIDIA H100 SXM bf16")
    assert world_peak_with_source("cuda", None, None, world_size=8) == (8 * 66.9e12, "GPU table: NVIDIA H100 SXM fp32")
    today = datetime.date.today().isoformat()
    measured = f"measured: best of 7 matmuls of 2048^2 at 4 threads, cached {today}"
    assert peak_with_source("cpu", None) == (1e11, measured)
    assert peak_with_source("cpu", None) == (1e11, measured)  # the second from the cache
    assert measurements == [torch.float32]


def test_a_theoretical_cpu_peak_is_used_without_measuring(monkeypatch, cache_home, measurements):
    source = "theoretical: 2 cores x 3.70 GHz x 64 FLOP/cycle (AVX-512, 2 FMA units)"
    monkeypatch.setattr(cpu_peak, "theoretical_cpu_peak", lambda dtype: (4.736e11, source))

    assert peak_with_source("cpu", None) == (4.736e11, source)
    assert measurements == []
    assert not cache_path().exists()


# -- the theoretical CPU peak ---------------------------------------------------------------------


def fake_cpuinfo(vendor: str, family: int, model: int, name: str, flags: str, cores: int = 2) -> str:
    """/proc/cpuinfo of one socket with ``cores`` cores of two hardware threads each, numbered as
    Linux does: processors 0..cores-1 are the first threads of each core, then the second ones."""
    blocks = []
    for processor in range(2 * cores):
        blocks.append(
            f"processor\t: {processor}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: {name}\ncpu MHz\t\t: 2400.000\nphysical id\t: 0\nsiblings\t: {2 * cores}\n"
            f"core id\t\t: {processor % cores}\ncpu cores\t: {cores}\nflags\t\t: fpu sse sse2 avx {flags}\n"
        )
    return "\n".join(blocks)


def fake_sysfs(root, cpus: int, max_khz: int):
    for cpu in range(cpus):
        folder = root / f"cpu{cpu}" / "cpufreq"
        folder.mkdir(parents=True)
        (folder / "cpuinfo_max_freq").write_text(f"{max_khz}\n")
    return root


AVX2 = "fma avx2"
AVX512 = f"{AVX2} avx512f avx512dq avx512bw avx512vl"

# (what, cpuinfo fields, fp32 FLOP/cycle/core, bf16 FLOP/cycle/core), None meaning no theoretical peak
CPU_TABLE = [
    ("Zen 5", ("AuthenticAMD", 26, 17, "AMD EPYC 9755 128-Core Processor", f"{AVX512} avx512_bf16"), 64, 128),
    ("Zen 4", ("AuthenticAMD", 25, 17, "AMD EPYC 9654 96-Core Processor", f"{AVX512} avx512_bf16"), 32, 64),
    ("Zen 3", ("AuthenticAMD", 25, 1, "AMD EPYC 7763 64-Core Processor", AVX2), 32, None),
    ("Zen 2", ("AuthenticAMD", 23, 49, "AMD EPYC 7742 64-Core Processor", AVX2), 32, None),
    ("Zen 1", ("AuthenticAMD", 23, 1, "AMD EPYC 7601 32-Core Processor", AVX2), None, None),
    ("Skylake Gold", ("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz", AVX512), 64, None),
    ("Skylake Silver", ("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Silver 4114 CPU @ 2.20GHz", AVX512), 32, None),
    ("Cooper Lake", ("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Platinum 8380H CPU", f"{AVX512} avx512_bf16"), 64, 128),
    ("Sapphire Rapids", ("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+", f"{AVX512} amx_bf16"), 64, 2048),
    ("Haswell", ("GenuineIntel", 6, 63, "Intel(R) Xeon(R) CPU E5-2680 v3 @ 2.50GHz", AVX2), 32, None),
    ("Sandy Bridge", ("GenuineIntel", 6, 45, "Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz", ""), None, None),
    ("Hygon", ("HygonGenuine", 24, 1, "Hygon C86 7185 32-core Processor", AVX2), None, None),
]


@pytest.mark.parametrize(("what", "fields", "fp32", "bf16"), CPU_TABLE, ids=[row[0] for row in CPU_TABLE])
def test_theoretical_peak_is_cores_times_clock_times_flop_per_cycle(tmp_path, what, fields, fp32, bf16):
    cpuinfo = fake_cpuinfo(*fields, cores=2)
    sysfs = fake_sysfs(tmp_path, cpus=4, max_khz=3_700_000)
    everything = {"cpuinfo": cpuinfo, "sysfs": sysfs, "affinity": {0, 1, 2, 3}, "threads": 8}

    for dtype, flop in ((torch.float32, fp32), (torch.bfloat16, bf16)):
        peak, source = theoretical_cpu_peak(dtype, **everything)
        if flop is None:
            assert peak is None
            assert source  # says why
        else:
            assert peak == pytest.approx(2 * 3.7e9 * flop)  # two physical cores, whatever the threads
            assert source.startswith(f"theoretical: 2 cores x 3.70 GHz x {flop} FLOP/cycle (")


def test_theoretical_source_names_the_units_and_the_reason_when_unknown(tmp_path):
    gold = fake_cpuinfo("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz", AVX512)
    sysfs = fake_sysfs(tmp_path, cpus=4, max_khz=3_700_000)
    known = {"sysfs": sysfs, "affinity": {0, 1, 2, 3}, "threads": 2}

    assert theoretical_cpu_peak(torch.float32, cpuinfo=gold, **known) == (
        pytest.approx(2 * 3.7e9 * 64),
        "theoretical: 2 cores x 3.70 GHz x 64 FLOP/cycle (AVX-512, 2 FMA units)",
    )
    peak, why = theoretical_cpu_peak(torch.bfloat16, cpuinfo=gold, **known)
    assert peak is None
    assert "no bf16 matrix instructions" in why
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n"
    peak, why = theoretical_cpu_peak(torch.float32, cpuinfo=arm, sysfs=sysfs, affinity={0}, threads=1)
    assert peak is None
    assert "FLOP per cycle not known" in why


def test_a_vm_without_cpufreq_has_no_theoretical_peak(tmp_path):
    zen5 = fake_cpuinfo("AuthenticAMD", 26, 2, "AMD EPYC", f"{AVX512} avx512_bf16")

    peak, why = theoretical_cpu_peak(torch.float32, cpuinfo=zen5, sysfs=tmp_path, affinity={0, 1}, threads=2)

    assert peak is None
    assert "cpuinfo_max_freq" in why
    assert "nominal clock" in why


def test_cores_used_are_the_threads_at_most_the_physical_cores_this_process_may_use(tmp_path):
    zen4 = fake_cpuinfo("AuthenticAMD", 25, 17, "AMD EPYC 9654", AVX512, cores=4)  # processors 0-7
    sysfs = fake_sysfs(tmp_path, cpus=8, max_khz=2_000_000)

    def cores(affinity, threads):
        peak, _ = theoretical_cpu_peak(torch.float32, cpuinfo=zen4, sysfs=sysfs, affinity=affinity, threads=threads)
        return peak / (2e9 * 32)

    assert cores(set(range(8)), threads=16) == pytest.approx(4)  # hardware threads add no FMA units
    assert cores(set(range(8)), threads=3) == pytest.approx(3)
    assert cores({0, 4}, threads=8) == pytest.approx(1)  # two threads of core 0
    assert cores({0, 1, 4}, threads=8) == pytest.approx(2)


def test_cpuinfo_without_topology_counts_every_cpu_as_a_core(tmp_path):
    text = fake_cpuinfo("GenuineIntel", 6, 63, "Intel(R) Xeon(R) CPU E5-2680 v3", AVX2, cores=2)
    text = "\n".join(line for line in text.splitlines() if not line.startswith(("core id", "physical id")))
    sysfs = fake_sysfs(tmp_path, cpus=4, max_khz=1_000_000)

    peak, _ = theoretical_cpu_peak(torch.float32, cpuinfo=text, sysfs=sysfs, affinity={0, 1, 2, 3}, threads=8)

    assert peak == pytest.approx(4 * 1e9 * 32)  # too high rather than too low: MFU errs low


# -- the measured CPU peak: cached only when idle, re-measured when proved wrong -----------------


def test_a_busy_measurement_is_used_for_this_run_only_and_not_cached(cache_home, measurements, load, capsys):
    load[0] = 3.6

    peak, source = peak_with_source("cpu", torch.float32)

    assert peak == 1e11
    assert source == "measured while busy (load 3.6 on 2 CPUs): best of 7 matmuls of 2048^2 at 4 threads, not cached"
    assert not cache_path().exists()
    warning = capsys.readouterr().err
    assert warning.startswith("forge: warning: the CPU peak for MFU was measured while busy")
    assert "used for this run only" in warning
    assert peak_with_source("cpu", torch.float32) == (1e11, source)  # reused by this process, not measured
    measured_peak._BUSY_MEASUREMENTS.clear()  # as in the next process
    load[0] = 0.2  # idle now: the next run measures again, and this time caches
    assert peak_with_source("cpu", torch.float32)[0] == 2e11
    assert json.loads(cache_path().read_text()) == {cpu_cache_key(torch.float32): entry(2e11)}


def test_an_idle_measurement_is_cached(cache_home, measurements, load):
    load[0] = 0.9  # under half of the 2 CPUs

    assert peak_flops("cpu", torch.float32) == 1e11
    assert json.loads(cache_path().read_text()) == {cpu_cache_key(torch.float32): entry(1e11)}


def test_remeasure_drops_the_cached_peak_and_caches_the_new_one(cache_home, measurements):
    assert peak_flops("cpu", torch.float32) == 1e11
    assert peak_flops("cpu", torch.bfloat16) == 2e11

    assert remeasure_cpu_peak(torch.float32) == 3e11

    assert json.loads(cache_path().read_text()) == {
        cpu_cache_key(torch.float32): entry(3e11),
        cpu_cache_key(torch.bfloat16): entry(2e11),  # the other dtype's is kept
    }
    assert peak_flops("cpu", torch.float32) == 3e11
    assert len(measurements) == 3


def test_remeasuring_on_a_busy_machine_leaves_no_entry(cache_home, measurements, load):
    assert peak_flops("cpu", torch.float32) == 1e11
    load[0] = 5.0

    assert remeasure_cpu_peak(torch.float32) == 2e11

    assert json.loads(cache_path().read_text()) == {}
    assert peak_flops("cpu", torch.float32) == 2e11  # this process keeps its busy measurement
    measured_peak._BUSY_MEASUREMENTS.clear()  # the next process
    load[0] = 0.0
    assert peak_flops("cpu", torch.float32) == 3e11  # measured again rather than the wrong value


def test_a_bare_number_from_an_older_cache_is_measured_again(cache_home, measurements):
    path = cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({cpu_cache_key(torch.float32): 5e9}))  # how it was measured is unknown

    assert peak_flops("cpu", torch.float32) == 1e11
    assert json.loads(path.read_text()) == {cpu_cache_key(torch.float32): entry(1e11)}


def test_machine_load_leaves_out_this_process(monkeypatch):
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (3.0, 2.0, 1.0))
    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(hardware, "_own_load", lambda: 1.0)

    assert hardware.machine_load() == (2.0, 4)


# -- fp16 ([train] precision = "fp16") --------------------------------------------------------------


# The datasheets' FP16 tensor rates with FP32 accumulation, dense (sparse figures halved); on
# every GPU with bf16 they equal its BF16 rate. V100 (SXM2) and T4 have fp16 tensor cores only.
@pytest.mark.parametrize(
    ("device_name", "fp16"),
    [
        ("NVIDIA H100 80GB HBM3", 1979e12 / 2),
        ("NVIDIA H200", 1979e12 / 2),
        ("NVIDIA A100-SXM4-80GB", 624e12 / 2),
        ("NVIDIA L4", 242e12 / 2),
        ("NVIDIA GeForce RTX 4090", 330.4e12 / 2),  # with FP32 accumulate: half the FP16-accumulate rate
        ("Tesla V100-SXM2-16GB", 125e12),
        ("Tesla T4", 65e12),
    ],
)
def test_known_gpus_get_their_dense_fp16_peak(monkeypatch, device_name, fp16):
    gpu_named(monkeypatch, device_name)

    assert peak_flops("cuda", torch.float16) == pytest.approx(fp16, rel=2e-3)
    _, source = peak_with_source("cuda", torch.float16)
    assert source.startswith("GPU table: NVIDIA ")
    assert source.endswith(" fp16")


def test_every_gpu_with_a_bf16_peak_has_the_same_fp16_peak():
    from forge_lm.metrics.gpu_peaks import GPU_PEAKS

    for _, label, peaks in GPU_PEAKS:
        assert "fp16" in peaks, label  # every CUDA GPU computes fp16
        if "bf16" in peaks:
            assert peaks["fp16"] == peaks["bf16"], label


def test_the_cpu_fp16_peak_is_measured_on_float16_products_and_cached_apart(cache_home, measurements):
    assert peak_flops("cpu", torch.float16) == 1e11
    assert peak_flops("cpu", torch.float32) == 2e11
    assert measurements == [torch.float16, torch.float32]
    cache = json.loads(cache_path().read_text())
    assert cache[cpu_cache_key(torch.float16)] == entry(1e11)
    assert cpu_cache_key(torch.float16).endswith(" | fp16 | torch.mm+F.linear")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precisions_measure_the_layout_of_a_linear_layer_too(monkeypatch, dtype):
    """torch emulates fp16 and bf16 products on CPUs without such units, and a linear layer's
    ``a @ b.T`` runs faster there than ``a @ b``: the peak is the faster (an MFU against the slower
    would exceed 1). Each kernel gets matrices of ``dtype`` and computes the product's FLOPs."""
    kernels = measured_peak.matmul_kernels(dtype)
    assert list(kernels) == ["torch.mm", "F.linear"]
    a, b = torch.randn(32, 32).to(dtype), torch.randn(32, 32).to(dtype)
    assert torch.equal(kernels["F.linear"](a, b), torch.nn.functional.linear(a, b))
    seen = []
    fakes = {name: (lambda a, b, name=name: seen.append((name, a.dtype, b.dtype)) or a) for name in kernels}
    monkeypatch.setattr(measured_peak, "matmul_kernels", lambda dtype: fakes)
    measured_peak._matmul_rate(64, dtype, repeats=2)
    assert {(a_dtype, b_dtype) for _, a_dtype, b_dtype in seen} == {(dtype, dtype)}
    assert {name for name, _, _ in seen} == {"torch.mm", "F.linear"}


def test_a_linear_layer_under_fp16_autocast_is_no_faster_than_the_fp16_peak_measured():
    """The real products at 256 (emulated fp16 is slow: one product takes milliseconds): a layer's
    product under fp16 autocast, timed like the measurement, stays below the measured peak (x1.5
    for timing noise on a shared machine)."""
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak = measured_peak._matmul_rate(256, torch.float16, repeats=3)
        x, weight = torch.randn(256, 256), torch.randn(256, 256)
        best = math.inf
        for _ in range(4):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.float16):
                out = torch.nn.functional.linear(x, weight)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert out.dtype == torch.float16
    assert 2 * 256**3 / best < 1.5 * peak


FP16_CPUS = [  # (what, flags beyond AVX-512, fp16 FLOP/cycle/core or None: measured instead)
    ("Granite Rapids", "avx512_bf16 avx512_fp16 amx_bf16 amx_fp16 amx_tile", 2048),
    ("Sapphire Rapids", "avx512_bf16 avx512_fp16 amx_bf16 amx_tile", None),
    ("Zen 4", "avx512_bf16", None),
]


@pytest.mark.parametrize(("what", "flags", "fp16"), FP16_CPUS, ids=[row[0] for row in FP16_CPUS])
def test_the_theoretical_fp16_peak_is_known_with_amx_fp16_only(tmp_path, what, flags, fp16):
    cpuinfo = fake_cpuinfo("GenuineIntel", 6, 173, f"Intel(R) Xeon(R) {what}", f"{AVX512} {flags}")
    sysfs = fake_sysfs(tmp_path, cpus=4, max_khz=3_000_000)

    peak, source = theoretical_cpu_peak(torch.float16, cpuinfo=cpuinfo, sysfs=sysfs, affinity={0, 1, 2, 3}, threads=2)

    if fp16 is None:
        assert peak is None
        assert "no fp16 matrix instructions (amx_fp16)" in source
    else:
        assert peak == pytest.approx(2 * 3e9 * fp16)
        assert source == "theoretical: 2 cores x 3.00 GHz x 2048 FLOP/cycle (AMX-FP16, 1024 multiply-adds)"
