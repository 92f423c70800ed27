"""benchmarks/_gpu_common.py: sides measured one after another, each freed before the next is
built, with its own peak memory; a failing side recorded without losing the others."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

CPU = torch.device("cpu")


class FakeSide:
    """Returns 100, 200, 300, ... tokens/s from successive ``run`` calls; logs what happens to it."""

    def __init__(self, name: str, log: list[str], fail_at_run: int | None = None) -> None:
        self.name, self.log, self.fail_at_run, self.calls = name, log, fail_at_run, 0
        self.first = (2.5, 1.0)
        log.append(f"build {name}")

    def run(self, steps: int) -> float:
        self.calls += 1
        self.log.append(f"run {self.name} {steps}")
        if self.calls == self.fail_at_run:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return 100.0 * self.calls

    def close(self) -> None:
        self.log.append(f"close {self.name}")


def test_each_side_is_built_run_and_closed_before_the_next_is_built(bench):
    common = bench("_gpu_common")
    log: list[str] = []

    results = common.measure_in_turn(
        {"a": lambda: FakeSide("a", log), "b": lambda: FakeSide("b", log)}, rounds=3, warmup=1, steps=7, device=CPU
    )

    assert log == ["build a", *["run a 7"] * 4, "close a", "build b", *["run b 7"] * 4, "close b"]
    assert results["a"].samples == [200.0, 300.0, 400.0]  # the warm-up round's 100 left out
    assert results["a"].tokens_per_s == 300.0
    assert results["a"].first_step_loss == 2.5
    assert results["a"].peak_memory_gib is None  # a CPU has no allocator statistics
    assert results["a"].error is None


def test_a_failing_side_is_recorded_and_the_others_still_run(bench, capsys):
    common = bench("_gpu_common")
    log: list[str] = []
    seen: list[list[str]] = []

    results = common.measure_in_turn(
        {
            "broken": lambda: FakeSide("broken", log, fail_at_run=2),
            "fine": lambda: FakeSide("fine", log),
        },
        rounds=2,
        warmup=0,
        steps=1,
        device=CPU,
        after_each=lambda so_far: seen.append(list(so_far)),
    )

    assert results["broken"].error == "RuntimeError: CUDA out of memory (a stand-in)"
    assert results["broken"].samples == [100.0]
    assert results["fine"].samples == [100.0, 200.0]
    assert seen == [["broken"], ["broken", "fine"]]  # partial results written after every side
    assert "broken: failed: RuntimeError" in capsys.readouterr().err


def test_sides_hold_no_memory_of_each_other(bench):
    """A side's model, caught in a reference cycle as real models are, is gone before the next
    side is built: the loop drops it and collects the cycle."""
    common = bench("_gpu_common")
    refs: list[weakref.ref] = []
    alive_at_build: list[list[bool]] = []

    def build() -> object:
        alive_at_build.append([ref() is not None for ref in refs])
        side = FakeSide("x", [])
        side.model = torch.nn.Linear(4, 4)
        side.model.owner = side  # a cycle: plain reference counting would not free it
        refs.append(weakref.ref(side.model))
        return side

    gc.disable()  # only the loop's own collection may free the cycle
    try:
        common.measure_in_turn({"a": build, "b": build, "c": build}, rounds=1, warmup=0, steps=1, device=CPU)
    finally:
        gc.enable()

    assert alive_at_build == [[], [False], [False, False]]
    assert [ref() for ref in refs] == [None, None, None]


class FakeAllocator:
    """torch.cuda's peak statistics on a CPU machine: ``allocate``/``release`` move the current
    figure, ``reset_peak_memory_stats`` sets the peak to it, as CUDA's caching allocator does."""

    def __init__(self) -> None:
        self.current = self.peak = 0
        self.resets = 0

    def allocate(self, gib: float) -> None:
        self.current += int(gib * 2**30)
        self.peak = max(self.peak, self.current)

    def release(self, gib: float) -> None:
        self.current -= int(gib * 2**30)

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.peak = self.current

    def max_memory_allocated(self, device=None) -> int:
        return self.peak


def test_on_cuda_each_side_reports_its_own_peak_memory(bench, monkeypatch):
    common = bench("_gpu_common")
    allocator = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", allocator.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", allocator.max_memory_allocated)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(allocator.current))

    class Side:
        def __init__(self, weights: float, activations: float) -> None:
            self.weights, self.activations = weights, activations
            allocator.allocate(weights)

        def run(self, steps: int) -> float:
            allocator.allocate(self.activations)  # the step's activations, freed at its end
            allocator.release(self.activations)
            return 1.0

        def close(self) -> None:
            allocator.release(self.weights)

    results = common.measure_in_turn(
        {"big": lambda: Side(40, 60), "small": lambda: Side(4, 6)},
        rounds=2,
        warmup=1,
        steps=1,
        device=torch.device("cuda"),
    )

    assert results["big"].peak_memory_gib == pytest.approx(100)
    assert results["small"].peak_memory_gib == pytest.approx(10)  # not big's 100: the peak was reset before it
    assert allocator.resets == 2
    assert emptied == [0, 0]  # the cache handed back after each side, nothing of it left


def test_publish_writes_the_record_and_its_table_to_the_output_directory(bench, tmp_path):
    common = bench("_gpu_common")
    rows = [{"side": "forge", "tokens_per_s": 1234.5, "peak_memory_gib": None}]
    record = bench("_record").make_record("gpu", "python benchmarks/bench_gpu.py", rows, "Some notes.")

    written = common.publish(record, tmp_path / "out", save_results=False)

    assert written == [tmp_path / "out" / "gpu.json", tmp_path / "out" / "gpu.md"]
    assert json.loads(written[0].read_text()) == record
    assert record.keys() >= {"benchmark", "command", "date", "machine", "notes", "rows"}  # what _record reads
    table = written[1].read_text()
    assert "Some notes." in table
    assert "| side | tokens_per_s | peak_memory_gib |" in table
    assert "| forge | 1234 | None |" in table  # _record's cell format: large numbers without decimals


def test_results_md_marks_a_section_measured_on_another_host(bench, tmp_path, monkeypatch):
    """Issue 35: two hosts' results are never mixed silently. Each record carries its CPU and
    matmul flags; RESULTS.md names the usual host and marks a section from another one."""
    record = bench("_record")
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(record, "HERE", tmp_path)
    (tmp_path / "results").mkdir()

    def write(name: str, cpu: str, flags: list[str]) -> None:
        made = record.make_record(name, f"bench_{name}.py", [{"ratio": 1.0}])
        made["machine"].update(cpu_model=cpu, cpus=2, cpu_flags=flags)
        (tmp_path / "results" / f"{name}.json").write_text(json.dumps(made))

    write("data", "AMD EPYC", ["avx2", "avx512_bf16"])
    write("train", "AMD EPYC", ["avx2", "avx512_bf16"])
    write("moe", "Intel Xeon", ["avx2", "amx_tile"])
    record.write_results_md()
    text = (tmp_path / "RESULTS.md").read_text()
    assert "Most sections ran on AMD EPYC, 2 CPUs (avx2 avx512_bf16)" in text
    moe = text.split("## moe")[1].split("## ")[0]
    assert "**Measured on another host than the rest of this file: Intel Xeon, 2 CPUs (avx2 amx_tile).**" in moe
    assert "another host" not in text.split("## train")[1]
    assert "machine" in record.make_record("x", "y", [])
    assert set(record.machine().get("cpu_flags", [])) <= set(record.MATMUL_FLAGS)


def test_a_headline_measured_on_another_host_is_marked_in_the_headline_table(bench, tmp_path, monkeypatch):
    record = bench("_record")
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(record, "HERE", tmp_path)
    (tmp_path / "results").mkdir()
    for name, cpu in (("data", "AMD EPYC"), ("train", "AMD EPYC"), ("moe", "Intel Xeon")):
        made = record.make_record(name, f"bench_{name}.py", [{"ratio": 1.0}], headline=[
            {"measure": f"{name} ratio", "value": 1.5, "meaning": "m"}])  # fmt: skip
        made["machine"].update(cpu_model=cpu, cpus=2, cpu_flags=["avx2"])
        (tmp_path / "results" / f"{name}.json").write_text(json.dumps(made))

    record.write_results_md()

    table = (tmp_path / "RESULTS.md").read_text().split("## Headline ratios")[1].split("Most sections")[0]
    assert "| [moe](#moe) (on Intel Xeon, 2 CPUs (avx2)) | moe ratio | 1.500 | m |" in table
    assert "| [train](#train) | train ratio | 1.500 | m |" in table


def test_the_benchmarks_flag_list_is_forges(bench):
    """The record names the same matrix flags as the keys of Forge's caches, which it reads."""
    from forge_lm import hardware

    assert bench("_record").MATMUL_FLAGS == hardware.MATRIX_FLAGS


def test_each_record_carries_the_kernel_rates_forge_cached_for_this_host_only(bench, tmp_path, monkeypatch):
    """The rates come from Forge's own caches as its measurements write them (an idle machine
    stood in for, the timings too); another host's entries of the same CPU name are left out."""
    import torch

    from forge_lm import hardware
    from forge_lm.metrics import measured_peak
    from forge_lm.model import linear_choice

    record = bench("_record")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "machine_load", lambda: (0.0, 2))
    monkeypatch.setattr(hardware, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(hardware, "matrix_flags", lambda: ["avx2", "fma"])
    monkeypatch.setattr(linear_choice, "_MADE", {})
    monkeypatch.setattr(measured_peak, "measure_cpu", lambda dtype: measured_peak.CpuMeasurement(1.5e11, 2048, 7, 2))
    measured_peak._measure_and_maybe_cache(torch.float32, measured_peak.cpu_cache_key(torch.float32))
    linear_choice.choose([(64, 32, 48)], lambda name, shape: 2.0 if name == "onednn" else 1.0)
    monkeypatch.setattr(hardware, "matrix_flags", lambda: ["avx2", "fma", "avx512f", "avx512_bf16"])  # another host
    measured_peak._measure_and_maybe_cache(torch.float32, measured_peak.cpu_cache_key(torch.float32))

    rates = record.kernel_rates("AMD EPYC", ["avx2", "fma"])

    threads = f"threads={torch.get_num_threads()}, torch={torch.__version__}"
    assert [{k: v for k, v in rate.items() if k != "date"} for rate in rates] == [
        {"what": "fp32 peak (" + "+".join(measured_peak.matmul_kernels(torch.float32)) + ")", "gflop_per_s": 150.0,
         "where": threads},
        {"what": "fp32 linear products ((64, 32, 48),): oneDNN / torch's speed", "ratio": 0.5, "where": threads},
    ]  # fmt: skip
    assert record.kernel_rates("Intel Xeon", ["avx2", "fma"]) == []
    made = record.make_record("x", "y", [])
    made["machine"].update(cpu_model="AMD EPYC", cpus=2, cpu_flags=["avx2", "fma"], kernel_rates=rates)
    hosts = "\n".join(record._hosts_section([made]))
    assert hosts.startswith("## Hosts\n\n**AMD EPYC, 2 CPUs (avx2 fma)**, measured by Forge when idle")
    assert "fp32 peak (" in hosts
    assert "150.0 GFLOP/s" in hosts
    assert "oneDNN / torch's speed 0.5x" in hosts
