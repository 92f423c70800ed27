"""``cpu_linear_kernel = "auto"`` chooses by measurement on this host: oneDNN only where it timed
at least MARGIN faster than torch's kernel on the model's products; the choice is cached per
host only when the machine was idle, and reused within a process."""

from __future__ import annotations

import json

import pytest

from forge_lm import hardware
from forge_lm.model import linear_choice
from forge_lm.model.linear_choice import MARGIN, choose, measure

SHAPES = [(64, 32, 48), (64, 48, 32)]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(linear_choice, "_MADE", {})
    monkeypatch.setattr(hardware, "machine_load", lambda: (0.0, 2))  # idle unless a test says otherwise


def timer_with(onednn_s: float, aten_s: float, calls: list | None = None):
    def timer(name, shape):
        if calls is not None:
            calls.append((name, shape))
        return onednn_s if name == "onednn" else aten_s

    return timer


@pytest.mark.parametrize(
    ("onednn_s", "aten_s", "onednn"),
    [
        (1.0, 2.0, True),  # twice as fast (an AMD EPYC's fp32 GEMM)
        (1.0, MARGIN * 1.01, True),
        (1.0, MARGIN * 0.99, False),  # a near tie keeps torch's kernel
        (2.0, 1.0, False),  # slower (an Intel Xeon with AMX)
    ],
)
def test_onednn_is_chosen_only_where_it_measured_the_margin_faster(onednn_s, aten_s, onednn):
    choice = choose(SHAPES, timer_with(onednn_s, aten_s))
    assert choice.onednn is onednn
    assert f"oneDNN measured {aten_s / onednn_s / len(SHAPES) * len(SHAPES):.2f}x" in choice.reason


def test_both_kernels_are_timed_alternately_on_every_shape_after_a_warm_up():
    calls = []
    onednn_s, aten_s = measure(SHAPES, timer_with(1.0, 3.0, calls))
    assert (onednn_s, aten_s) == (2.0, 6.0)  # the best of each shape's rounds, summed over shapes
    rounds = linear_choice.ROUNDS + 1
    assert len(calls) == rounds * 2 * len(SHAPES)
    firsts = [calls[i * 2 * len(SHAPES)][0] for i in range(rounds)]
    assert firsts == ["aten", "onednn"] * (rounds // 2) + ["aten"] * (rounds % 2)  # who goes first alternates


def test_an_idle_measurement_is_cached_for_this_host_and_reused_by_the_next_process(tmp_path):
    first = choose(SHAPES, timer_with(1.0, 2.0))
    assert "measured now" in first.reason
    cached = json.loads((tmp_path / "cache" / "forge_lm" / "linear_kernel.json").read_text())
    (key,) = cached
    assert hardware.cpu_model() in key
    assert cached[key]["onednn"] is True
    linear_choice._MADE.clear()  # a new process: only the disk cache is left

    def never(name, shape):
        raise AssertionError("measured again although the choice was cached")

    again = choose(SHAPES, never)
    assert again.onednn is True
    assert "cached" in again.reason


def test_a_measurement_on_a_busy_machine_serves_this_process_only(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "machine_load", lambda: (4.0, 2))
    choice = choose(SHAPES, timer_with(2.0, 1.0))
    assert choice.onednn is False
    assert "measured while busy (load 4.0), not cached" in choice.reason
    assert not (tmp_path / "cache" / "forge_lm" / "linear_kernel.json").exists()
    assert choose(SHAPES, timer_with(1.0, 9.0)) == choice  # the same process keeps its choice


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"key": {"onednn": "yes"}}', '{"a": ' * 5000])
def test_a_damaged_cache_is_measured_over(tmp_path, content):
    path = tmp_path / "cache" / "forge_lm" / "linear_kernel.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert choose(SHAPES, timer_with(1.0, 2.0)).onednn is True
    assert isinstance(json.loads(path.read_text()), dict)


def test_the_model_shapes_are_its_fp32_linear_layers_at_the_runs_tokens(manager):
    from forge_lm.config import LlamaOptions
    from forge_lm.model import build_model
    from forge_lm.model.linear_choice import linear_shapes

    model = build_model(LlamaOptions(dim=32, n_layers=1, n_heads=4, max_seq_len=64), 61, manager.registry)
    shapes = set(linear_shapes(model, 128))
    assert shapes == {(128, 32, 32), (128, 32, 128), (128, 128, 32), (128, 32, 61)}  # attention, SwiGLU 128, head


def test_a_real_measurement_gives_a_choice_and_its_reason():
    from forge_lm.model.linear import onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN linear kernel to measure")
    choice = choose(SHAPES)
    assert isinstance(choice.onednn, bool)
    assert "oneDNN measured" in choice.reason


def test_one_process_keeps_one_choice_per_model_whatever_the_batch(monkeypatch, tmp_path):
    """A gradient-accumulation run (micro-batch 4) and its one-big-batch twin (8) must take the
    same kernel, or they round differently: the choice is made once per model's products."""
    monkeypatch.setattr(linear_choice, "_MADE", {})
    monkeypatch.setattr(linear_choice, "cache_path", lambda: tmp_path / "linear_kernel.json")
    calls = []

    def timer(name, shape):
        calls.append(shape)
        return 1.0 if name == "onednn" else 1.5  # oneDNN 1.5x faster: chosen

    big = linear_choice.choose([(1024, 64, 256), (1024, 256, 64)], timer)
    measured = len(calls)
    small = linear_choice.choose([(512, 64, 256), (512, 256, 64)], lambda name, shape: 1.0)  # would say aten
    assert (big.onednn, small.onednn) == (True, True)
    assert len(calls) == measured  # not measured again


def test_a_choice_cached_on_another_host_of_the_same_name_is_not_reused(monkeypatch):
    """Two "AMD EPYC" hosts, one with AVX-512 (oneDNN twice MKL's speed) and one with AVX2 only
    (MKL faster): the cache is keyed by the matrix flags too, so the second measures its own."""
    monkeypatch.setattr(hardware, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(hardware, "matrix_flags", lambda: ["avx2", "fma", "avx512f", "avx512_bf16"])
    assert choose(SHAPES, timer_with(1.0, 2.0)).onednn is True
    monkeypatch.setattr(linear_choice, "_MADE", {})  # the next process
    monkeypatch.setattr(hardware, "matrix_flags", lambda: ["avx2", "fma"])

    second = choose(SHAPES, timer_with(1.2, 1.0))

    assert second.onednn is False
    assert second.reason.endswith("measured now")


def test_the_matrix_flags_are_read_from_cpuinfo_in_a_fixed_order():
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx512_bf16 fma avx2 avx512f amx_tile\n"

    assert hardware.matrix_flags(cpuinfo) == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]
    assert hardware.matrix_flags("model name\t: no flags line\n") == []
