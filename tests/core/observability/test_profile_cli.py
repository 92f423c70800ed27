"""``forge profile``: the top operators of a run's profiled steps, from StepProfiler's files.

The profiles are made by StepProfiler itself on a tiny MLP (for rank 1 only: the command must
find a rank other than 0 on its own); damaged and hostile files are written by hand. One test
trains with ``forge train`` and profiles the run end to end.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from forge_lm.cli._main import main
from forge_lm.cli._profile import load_profile
from forge_lm.config import ProfilingSection
from forge_lm.testing import TINY_MODEL
from forge_lm.train.profiling import StepProfiler

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def profile_run(run_dir: Path, rank: int, steps: int = 7) -> Path:
    """Windows 2-3 and 5-6 of a tiny MLP's training, profiled as ``rank``."""
    section = ProfilingSection(enabled=True, start_step=2, warmup_steps=1, active_steps=2, repeat=2, with_stack=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with StepProfiler(section, run_dir, rank, torch.device("cpu")) as profiler:
        for step in range(1, steps + 1):
            model(torch.randn(32, 16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step(step)
    return run_dir


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    """A run profiled on rank 1 only (made once; tests copy it before changing it)."""
    return profile_run(tmp_path_factory.mktemp("profiled") / "run", rank=1)


@pytest.fixture
def run_dir(profiled, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(profiled, copy, symlinks=True)
    return copy


def table_rows(out: str) -> list[list[str]]:
    """The table's rows: [#, self CPU ms, CPU %, calls, operator]."""
    rows = []
    for line in out.splitlines():
        match = re.fullmatch(r"\s*(\d+)\s+([\d.]+)\s+([\d.]+%|-)\s+(\d+)\s+(.+)", line)
        if match:
            rows.append(list(match.groups()))
    return rows


def summed(run_dir: Path, rank: int, name: str) -> tuple[int, float]:
    """An operator's calls and self CPU time (us) summed over the rank's summaries."""
    calls, time = 0, 0.0
    for path in (run_dir / "profiles" / f"rank{rank}").glob("ops_*.json"):
        for op in json.loads(path.read_text())["ops"]:
            if op["name"] == name:
                calls, time = calls + op["calls"], time + op["self_cpu_us"]
    return calls, time


def test_profile_finds_rank_1_and_shows_its_windows_summed(run_dir, capsys):
    code = main(["profile", str(run_dir), "--top", "5"])

    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[0] == "rank 1 on cpu, 2 windows summed (steps 2-3, 5-6): top 5 operators by self CPU time"
    rows = table_rows(out)
    assert [row[0] for row in rows] == ["1", "2", "3", "4", "5"]
    times = [float(row[1]) for row in rows]
    assert times == sorted(times, reverse=True)
    addmm = next(row for row in rows if row[4] == "aten::addmm")  # the Linear layers: surely among the top
    calls, time = summed(run_dir, 1, "aten::addmm")
    assert int(addmm[3]) == calls == 8  # 2 layers x 2 steps x 2 windows
    assert float(addmm[1]) == pytest.approx(time / 1000, abs=0.0005)
    assert out.splitlines()[-1] == f"wrote {run_dir / 'profiles' / 'top_ops.png'}"
    assert (run_dir / "profiles" / "top_ops.png").read_bytes().startswith(PNG_SIGNATURE)


def test_profile_writes_the_chart_where_asked(run_dir, tmp_path, capsys):
    output = tmp_path / "charts" / "ops.png"

    assert main(["profile", str(run_dir), "--rank", "1", "--output", str(output)]) == 0

    assert output.read_bytes().startswith(PNG_SIGNATURE)
    assert not (run_dir / "profiles" / "top_ops.png").exists()
    assert len(table_rows(capsys.readouterr().out)) == 15  # the default --top


def test_the_raw_traces_give_the_summaries_numbers(run_dir):
    from_summaries = load_profile(run_dir)
    for summary in run_dir.glob("profiles/rank1/ops_*.json"):
        summary.unlink()
    for trace in run_dir.glob("profiles/rank1/trace_step5-6.json"):  # one trace gzipped: read as well
        trace.with_name(trace.name + ".gz").write_bytes(gzip.compress(trace.read_bytes()))
        trace.unlink()

    from_traces = load_profile(run_dir)

    assert from_traces.windows == from_summaries.windows == [(2, 3), (5, 6)]
    for name in ("aten::addmm", "aten::mm", "aten::relu"):
        calls, cpu, _ = from_traces.ops[(name, False)]
        assert calls == from_summaries.ops[(name, False)][0]
        assert cpu == pytest.approx(from_summaries.ops[(name, False)][1], rel=1e-6)


def test_profile_of_a_rank_without_profiles_names_those_with(run_dir, capsys):
    assert main(["profile", str(run_dir), "--rank", "0"]) == 2

    assert capsys.readouterr().err == (
        f"forge: error: rank 0 has no profiles in '{run_dir / 'profiles'}'; ranks with profiles: 1.\n"
    )


def test_a_run_without_profiles_is_told_how_to_get_them(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")

    assert main(["profile", str(tmp_path)]) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"forge: error: '{tmp_path}' holds no profiles")
    assert "`[profiling] enabled = true`" in err
    assert "Traceback" not in err


def test_a_missing_run_directory_is_an_error(tmp_path, capsys):
    assert main(["profile", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"forge: error: no run directory at '{tmp_path / 'nowhere'}'.\n"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"traceEvents": [{"ph": "X", "name": "aten::mm"', "it is not valid JSON"),
        ('{"schemaVersion": 1}', "it has no list of trace events"),
        (b"\xff\xfe not text", "it is not valid JSON"),
    ],
)
def test_a_damaged_trace_is_an_error_naming_it(run_dir, capsys, content, why):
    rank_dir = run_dir / "profiles" / "rank1"
    (rank_dir / "ops_step5-6.json").unlink()  # so the trace of 5-6 is read
    trace = rank_dir / "trace_step5-6.json"
    if isinstance(content, bytes):
        trace.write_bytes(content)
    else:
        trace.write_text(content)

    assert main(["profile", str(run_dir)]) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"forge: error: '{trace}' is damaged: {why}")
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("summary", "why"),
    [
        ("[1, 2", "it is not valid JSON"),
        ('{"ops": "aten::mm"}', "it has no list of operators"),
        ('{"self_cpu_us_total": 1, "ops": [{"name": "aten::mm", "calls": 1, "self_cpu_us": NaN}]}', "'self_cpu_us'"),
        ('{"self_cpu_us_total": 1, "ops": [{"calls": 1, "self_cpu_us": 2}]}', "an operator has no name"),
        ('{"self_cpu_us_total": 1, "ops": [{"name": "x", "calls": "1", "self_cpu_us": 2}]}', "'calls' is '1'"),
    ],
)
def test_a_damaged_summary_is_an_error_naming_it(run_dir, capsys, summary, why):
    path = run_dir / "profiles" / "rank1" / "ops_step2-3.json"
    path.write_text(summary)

    assert main(["profile", str(run_dir)]) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"forge: error: '{path}' is damaged: ")
    assert why in err


def test_a_damaged_gzip_trace_is_an_error_naming_it(run_dir, capsys):
    rank_dir = run_dir / "profiles" / "rank1"
    for path in rank_dir.iterdir():
        path.unlink()
    trace = rank_dir / "trace_step2-3.json.gz"
    trace.write_bytes(gzip.compress(b'{"traceEvents": []}')[:-6])

    assert main(["profile", str(run_dir)]) == 2
    assert capsys.readouterr().err.startswith(f"forge: error: '{trace}' is damaged: its gzip data")


def test_a_gzip_trace_that_expands_past_the_cap_is_refused_as_damaged(run_dir, capsys, monkeypatch):
    from forge_lm.cli import _profile

    monkeypatch.setattr(_profile, "MAX_TRACE_BYTES", 4096)  # 1 GiB in use: a small bomb stands for a large one
    rank_dir = run_dir / "profiles" / "rank1"
    for path in rank_dir.iterdir():
        path.unlink()
    trace = rank_dir / "trace_step2-3.json.gz"
    # Valid JSON, so only the cap refuses it: 64 KiB of it from a few hundred bytes of gzip.
    trace.write_bytes(gzip.compress(b'{"traceEvents": []}' + b" " * 65536))
    assert trace.stat().st_size < 1024

    assert main(["profile", str(run_dir)]) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"forge: error: '{trace}' is damaged: it decompresses to more than ")
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_files_that_link_outside_the_run_directory_are_not_read(tmp_path, capsys):
    outside = profile_run(tmp_path / "elsewhere", rank=0)
    run_dir = tmp_path / "run"
    (run_dir / "profiles" / "rank0").mkdir(parents=True)
    (run_dir / "profiles" / "rank0" / "trace_step2-3.json").symlink_to(
        outside / "profiles" / "rank0" / "trace_step2-3.json"
    )
    (run_dir / "profiles" / "rank1").symlink_to(outside / "profiles" / "rank0", target_is_directory=True)

    assert main(["profile", str(run_dir)]) == 2

    err = capsys.readouterr().err
    assert "holds no profiles" in err
    assert f"skipped '{run_dir / 'profiles' / 'rank0' / 'trace_step2-3.json'}': it links outside" in err
    assert f"skipped '{run_dir / 'profiles' / 'rank1'}': it links outside" in err


def test_a_bad_top_is_a_usage_error(run_dir, capsys):
    assert main(["profile", str(run_dir), "--top", "0"]) == 2
    assert capsys.readouterr().err == "forge: error: --top must be 1 or more, got 0.\n"


def test_sorting_by_device_time_of_a_cpu_run_is_refused(run_dir, capsys):
    assert main(["profile", str(run_dir), "--sort", "device"]) == 2
    assert "no device times" in capsys.readouterr().err


def test_without_matplotlib_the_error_names_the_extra(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)

    assert main(["profile", str(run_dir)]) == 2

    out, err = capsys.readouterr()
    assert "aten::addmm" in out  # the table comes first: it needs no matplotlib
    assert "`pip install forge-lm[plot]`" in err


# -- end to end: forge train with [profiling], then forge profile ------------------------------

TINY = (
    *TINY_MODEL,
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--train.max_steps=5",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
)


def test_forge_train_profiles_the_window_and_forge_profile_reads_it(forge_cli, tmp_path):
    run_dir = tmp_path / "run"
    profiling = ("--profiling.enabled=true", "--profiling.start_step=2", "--profiling.active_steps=2")

    trained = forge_cli("train", *TINY, f"--train.output_dir={run_dir}", *profiling)

    assert trained.returncode == 0, trained.stderr
    rank_dir = run_dir / "profiles" / "rank0"
    names = sorted(path.name for path in rank_dir.iterdir())
    assert names == ["ops_step2-3.json", "trace_step2-3.json"]  # light by default: stacks only with with_stack
    assert "USDT" not in trained.stderr  # libkineto's profiler_start/stop lines stay off the console
    size = (rank_dir / "trace_step2-3.json").stat().st_size
    in_words = f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"
    assert f"written to {rank_dir / 'trace_step2-3.json'} ({in_words}; 2 files," in trained.stderr
    events = json.loads((rank_dir / "trace_step2-3.json").read_text())["traceEvents"]
    spans = sorted({e["name"] for e in events if e.get("name", "").startswith("forge/step_")})
    assert spans == ["forge/step_2", "forge/step_3"]  # warm-up on step 1, then 2 and 3

    shown = forge_cli("profile", str(run_dir), "--top", "8")

    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "rank 0 on cpu, steps 2-3: top 8 operators by self CPU time"
    assert len(table_rows(shown.stdout)) == 8
    assert (run_dir / "profiles" / "top_ops.png").read_bytes().startswith(PNG_SIGNATURE)


def test_a_cuda_runs_summary_is_ranked_by_device_time(tmp_path, capsys):
    # As StepProfiler writes it on CUDA: kernels are rows of their own, and their time is also
    # charged to the operator that launched them; the total counts the kernels once.
    rank_dir = tmp_path / "profiles" / "rank0"
    rank_dir.mkdir(parents=True)
    ops = [
        {"name": "aten::mm", "calls": 4, "self_cpu_us": 40.0, "cpu_total_us": 50.0, "self_device_us": 900.0},
        {"name": "aten::copy_", "calls": 2, "self_cpu_us": 30.0, "cpu_total_us": 30.0, "self_device_us": 50.0},
        {"name": "cudaLaunchKernel", "calls": 6, "self_cpu_us": 20.0, "cpu_total_us": 20.0, "self_device_us": 0.0},
        {"name": "sm90_gemm", "calls": 4, "self_cpu_us": 0.0, "cpu_total_us": 0.0, "self_device_us": 900.0},
        {"name": "memcpy DtoD", "calls": 2, "self_cpu_us": 0.0, "cpu_total_us": 0.0, "self_device_us": 50.0},
    ]
    for op in ops:
        op["kernel"] = op["self_cpu_us"] == 0.0
    summary = {
        "format": 1,
        "rank": 0,
        "device": "cuda",
        "steps": [3, 4],
        "self_cpu_us_total": 90.0,
        "self_device_us_total": 950.0,
        "ops": ops,
    }
    (rank_dir / "ops_step3-4.json").write_text(json.dumps(summary))

    assert main(["profile", str(tmp_path), "--top", "3"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rank 0 on cuda, steps 3-4: top 3 operators by self device time"
    columns = ["#", "self CPU ms", "CPU %", "self device ms", "device %", "calls", "operator"]
    assert re.split(r"\s{2,}", lines[1].strip()) == columns
    assert [line.split()[-1] for line in lines[2:5]] == ["aten::mm", "sm90_gemm", "aten::copy_"]
    assert lines[2].split()[:6] == ["1", "0.040", "44.4%", "0.900", "94.7%", "4"]
    assert (tmp_path / "profiles" / "top_ops.png").read_bytes().startswith(PNG_SIGNATURE)
