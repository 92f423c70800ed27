"""The 'console' backend: plain lines off a terminal, a live rich progress display on one."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from forge_lm.components import MetricsContext
from forge_lm.config import structure_options
from forge_lm.errors import ConfigError
from forge_lm.metrics.console import ConsoleBackend, plugins_line
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing._references import read_console

MANIFEST = [{"name": "core.metrics", "distribution": "forge-lm", "version": "0.1.0"}]


@pytest.fixture(scope="module")
def manager() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))


def build(manager, total_steps=0, **table) -> ConsoleBackend:
    component = manager.registry.resolve("metrics_backends", "console")
    options = structure_options(manager.registry, component, table, "metrics.console")
    return component.build(options, MetricsContext(run_dir=".", total_steps=total_steps))


@pytest.fixture(autouse=True)
def frozen_time(monkeypatch):
    """No time passes in these tests, so plain lines read ``[0:00]`` (and ``<0:00`` once a rate
    is known) whatever the machine's speed; the timing itself is tested with a fake clock."""
    import forge_lm.metrics.console as console

    monkeypatch.setattr(console, "time", SimpleNamespace(monotonic=lambda: 0.0))


class FakeTerminal(io.StringIO):
    """Standard output as a terminal would present it to isatty()."""

    def isatty(self) -> bool:
        return True


def test_off_a_terminal_each_step_is_one_plain_line(manager, capsys):
    backend = build(manager, total_steps=10)

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 3.25, "lr": 1e-4})
    backend.log(2, {"loss": 2.0, "lr": 2.5e-4, "tokens_per_sec": 12345.0, "grad_norm": float("nan")})
    backend.finish({"final_loss": 2.0, "tokens": 4096})

    assert capsys.readouterr().out == (
        "plugins: forge-lm 0.1.0\n"
        "step 1/10 [0:00] | loss 3.25 | loss_avg 3.25 | lr 0.0001\n"  # the first average is the first loss
        "step 2/10 [0:00<0:00] | loss 2 | loss_avg 2.592 | lr 0.00025 | tokens_per_sec 12345 | grad_norm nan\n"
        "summary: final_loss 2 | tokens 4096\n"
    )


def moe_like_step(loss: float) -> dict[str, float]:
    """A step as an MoE run logs it: the headline metrics among per-layer router statistics."""
    metrics = {"loss": loss, "lr": 0.001, "grad_norm": 1.5}
    for layer in range(4):
        for name in ("balance_loss", "z_loss", "load_min", "load_max", "load_cv", "drop_fraction"):
            metrics[f"moe/layer{layer}/{name}"] = 0.123456
    return {**metrics, "tokens_per_sec": 2500.0, "mfu": 0.0125}


def test_off_a_terminal_per_layer_metrics_are_counted_once_and_left_to_metrics_jsonl(manager, capsys):
    backend = build(manager, total_steps=10, smoothing=0)

    backend.start({}, MANIFEST)
    backend.log(1, moe_like_step(5.5))
    backend.log(2, moe_like_step(5.25))
    backend.log(2, {"eval/loss": 5.0, "eval/perplexity": 148.4})
    backend.finish({"final_loss": 5.25, "steps": 2})

    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines == [
        "note: 24 more metrics per step (moe/layer0/balance_loss, moe/layer0/drop_fraction, moe/layer0/load_cv, ...) "
        "are not shown on these lines; the jsonl backend (on by default) writes every metric to metrics.jsonl",
        "step 1/10 [0:00] | loss 5.5 | lr 0.001 | grad_norm 1.5 | tokens_per_sec 2500 | mfu 0.0125",
        "step 2/10 [0:00<0:00] | loss 5.25 | lr 0.001 | grad_norm 1.5 | tokens_per_sec 2500 | mfu 0.0125",
        "step 2/10 [0:00<0:00] | eval/loss 5 | eval/perplexity 148.4",
        "summary: final_loss 5.25 | steps 2",
    ]
    assert read_console(Path("."), "\n".join(lines)) == [  # forge_lm.testing's reader still parses them
        (1, {"loss": 5.5, "lr": 0.001, "grad_norm": 1.5, "tokens_per_sec": 2500.0, "mfu": 0.0125}),
        (2, {"loss": 5.25, "lr": 0.001, "grad_norm": 1.5, "tokens_per_sec": 2500.0, "mfu": 0.0125}),
        (2, {"eval/loss": 5.0, "eval/perplexity": 148.4}),
    ]


def test_off_a_terminal_a_few_other_metrics_stay_on_the_line(manager, capsys):
    backend = build(manager)

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 3.0, "loss/z": 0.25, "router/balance": 0.5, "lr": 0.01})
    backend.finish({})

    assert capsys.readouterr().out.splitlines()[1:] == [
        "step 1 | loss 3 | loss_avg 3 | loss/z 0.25 | router/balance 0.5 | lr 0.01"
    ]


def test_off_a_terminal_new_left_out_metrics_get_a_note_of_their_own(manager, capsys):
    backend = build(manager)
    others = {f"extra/{i}": 1.0 for i in range(5)}

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 3.0, **others})
    backend.log(2, {"loss": 2.0, **others})
    backend.log(3, {"loss": 1.0, **others, "extra/5": 1.0})
    backend.finish({})

    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert [note.split(" (")[0] for note in notes] == ["note: 5 more metrics per step", "note: 6 more metrics per step"]


def test_digits_sets_the_significant_digits_of_plain_lines(manager, capsys):
    backend = build(manager, digits=2)

    backend.start({}, MANIFEST)
    backend.log(7, {"loss": 3.14159, "lr": 0.000123456})
    backend.finish({})

    assert capsys.readouterr().out.splitlines()[1:] == ["step 7 | loss 3.1 | loss_avg 3.1 | lr 0.00012"]


def test_live_false_keeps_plain_lines_even_on_a_terminal(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    backend = ConsoleBackend(digits=4, total_steps=10, live=False)

    backend.start({}, MANIFEST)
    backend.log(3, {"loss": 1.5})
    backend.finish({})

    assert terminal.getvalue() == "plugins: forge-lm 0.1.0\nstep 3/10 [0:00] | loss 1.5\n"


def test_a_terminal_stdout_gets_the_live_display_instead_of_lines(manager, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    backend = build(manager, total_steps=10)

    backend.start({}, MANIFEST)
    backend.log(3, {"loss": 1.5, "lr": 0.001})
    backend.finish({"final_loss": 1.5})

    out = terminal.getvalue()
    assert "step 3 | loss" not in out  # no plain line
    assert "3/10" in out
    assert "loss 1.5 (avg 1.5) | lr 0.001" in out
    assert "summary: final_loss 1.5" in out


def live_backend(total_steps: int, width: int = 160) -> tuple[ConsoleBackend, io.StringIO]:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=width, color_system=None)
    return ConsoleBackend(digits=4, total_steps=total_steps, console=console), buffer


def test_live_display_draws_step_loss_lr_throughput_and_eta_of_each_logged_step():
    backend, buffer = live_backend(total_steps=100)

    backend.start({}, MANIFEST)
    backend.log(10, {"loss": 3.25, "lr": 1e-4, "tokens_per_sec": 12345.6, "mfu": 0.4123})
    first = buffer.getvalue()
    backend.log(20, {"loss": 2.875, "lr": 2e-4, "tokens_per_sec": 23456.0})
    backend.finish({"final_loss": 2.875})
    out = buffer.getvalue()

    assert "plugins: forge-lm 0.1.0" in first
    assert "10/100" in first
    assert "loss 3.25 | lr 0.0001 | 12,346 tok/s | mfu 41.2%" in first
    assert "eta" in first
    assert "20/100" in out
    assert "loss 2.875 | lr 0.0002 | 23,456 tok/s" in out
    assert out.rstrip().endswith("summary: final_loss 2.875")


def test_live_display_keeps_evaluation_lines_above_the_bar_and_training_values_on_it():
    backend, buffer = live_backend(total_steps=100)

    backend.start({}, MANIFEST)
    backend.log(50, {"loss": 3.0, "lr": 0.001, "tokens_per_sec": 5000.0})
    backend.log(50, {"eval/loss": 2.75, "eval/perplexity": 15.64})
    backend.finish({})

    out = buffer.getvalue()
    assert "step 50 | eval/loss 2.75 | eval/perplexity 15.64" in out
    assert "loss 3 | eval 2.75 | lr 0.001 | 5,000 tok/s" in out


def test_live_display_with_unknown_length_counts_steps_without_a_total():
    backend, buffer = live_backend(total_steps=0)

    backend.start({}, MANIFEST)
    backend.log(4, {"loss": 1.25})
    backend.finish({})

    out = buffer.getvalue()
    assert "4/?" in out
    assert "loss 1.25" in out


def test_live_display_restores_standard_output_when_finished():
    backend, _ = live_backend(total_steps=10)
    before = sys.stdout

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 1.0})
    backend.finish({})

    assert sys.stdout is before


def test_a_narrow_terminal_crops_the_values_but_keeps_the_step_count_and_eta():
    backend, buffer = live_backend(total_steps=2000, width=40)

    backend.start({}, MANIFEST)
    backend.log(1500, {"loss": 3.539, "lr": 1.018e-4, "tokens_per_sec": 1549.2, "mfu": 0.012})
    backend.finish({})

    lines = buffer.getvalue().replace("\r", "\n").splitlines()
    assert any("1500/2000" in line and "eta" in line for line in lines)
    assert "loss 3.539 | lr 0.0001018 | 1,549 tok/s…" in lines  # 40 columns, the last an ellipsis


def weighted_mean(losses: list[float], weight: float) -> float:
    """The debiased moving average written out: the mean of the losses, the latest weighing 1,
    each older one ``weight`` times its successor."""
    n = len(losses)
    weights = [weight ** (n - 1 - i) for i in range(n)]
    return sum(w * x for w, x in zip(weights, losses, strict=True)) / sum(weights)


def test_loss_avg_is_the_debiased_moving_average_of_the_logged_losses(manager, capsys):
    losses = [4.0, 3.0, 3.5, 2.0, 2.25]
    backend = build(manager, digits=12, smoothing=0.8)

    backend.start({}, MANIFEST)
    for i, loss in enumerate(losses):
        backend.log(10 * (i + 1), {"loss": loss, "lr": 0.001})
    backend.finish({})

    recorded = read_console(Path("."), capsys.readouterr().out)
    assert [step for step, _ in recorded] == [10, 20, 30, 40, 50]
    averages = [metrics["loss_avg"] for _, metrics in recorded]
    assert averages == pytest.approx([weighted_mean(losses[: n + 1], 0.8) for n in range(len(losses))], rel=1e-10)
    assert averages[0] == 4.0  # debiased: not 0.2 * 4.0, as an average starting from 0 would be
    assert averages[1] == pytest.approx((0.8 * 4.0 + 3.0) / 1.8, rel=1e-10)


def test_the_default_smoothing_is_0_9(manager, capsys):
    backend = build(manager, digits=12)

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 3.0})
    backend.log(2, {"loss": 1.0})
    backend.finish({})

    (_, first), (_, second) = read_console(Path("."), capsys.readouterr().out)
    assert first["loss_avg"] == 3.0
    assert second["loss_avg"] == pytest.approx((0.9 * 3.0 + 1.0) / 1.9, rel=1e-10)


def test_smoothing_0_shows_no_average(manager, capsys):
    backend = build(manager, smoothing=0)

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 3.0, "lr": 0.01})
    backend.finish({})

    assert capsys.readouterr().out.splitlines()[1:] == ["step 1 | loss 3 | lr 0.01"]


def test_evaluations_and_non_finite_losses_leave_the_average_alone(manager, capsys):
    backend = build(manager, digits=12, smoothing=0.5)

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 4.0})
    backend.log(1, {"eval/loss": 100.0})
    backend.log(2, {"loss": float("nan")})
    backend.log(3, {"loss": float("inf")})
    backend.log(4, {"loss": 2.0})
    backend.finish({})

    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines[:4] == [
        "step 1 | loss 4 | loss_avg 4",
        "step 1 | eval/loss 100",  # no training loss: no average either
        "step 2 | loss nan | loss_avg 4",
        "step 3 | loss inf | loss_avg 4",
    ]
    assert read_console(Path("."), lines[4])[0][1]["loss_avg"] == pytest.approx(weighted_mean([4.0, 2.0], 0.5))


def test_a_first_loss_that_is_not_finite_has_no_average_yet(capsys):
    backend = ConsoleBackend(digits=4, live=False, smoothing=0.9)

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": float("nan")})
    backend.log(2, {"loss": 2.5})
    backend.finish({})

    assert capsys.readouterr().out.splitlines()[1:] == ["step 1 | loss nan", "step 2 | loss 2.5 | loss_avg 2.5"]


@pytest.mark.parametrize("value", [1, 1.5, -0.1])
def test_smoothing_outside_0_to_1_is_refused(manager, value):
    with pytest.raises(ConfigError, match=r"\[metrics.console\] smoothing: must be at least 0 and below 1"):
        build(manager, smoothing=value)


def test_live_display_shows_the_average_beside_the_loss():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=160, color_system=None)
    backend = ConsoleBackend(digits=4, total_steps=100, console=console, smoothing=0.9)

    backend.start({}, MANIFEST)
    backend.log(10, {"loss": 3.0, "lr": 0.001})
    first = buffer.getvalue()
    backend.log(20, {"loss": 1.0, "lr": 0.001})
    backend.log(20, {"eval/loss": 2.5})
    backend.finish({})
    out = buffer.getvalue()

    assert "loss 3 (avg 3) | lr 0.001" in first
    average = f"{(0.9 * 3.0 + 1.0) / 1.9:.4g}"  # 1.947
    assert f"loss 1 (avg {average}) | lr 0.001" in out
    assert f"loss 1 (avg {average}) | eval 2.5 | lr 0.001" in out  # an evaluation keeps the average shown
    assert "step 20 | eval/loss 2.5" in out


def test_live_display_without_smoothing_shows_the_loss_alone():
    backend, buffer = live_backend(total_steps=10)  # built directly: smoothing defaults to 0 there

    backend.start({}, MANIFEST)
    backend.log(1, {"loss": 1.25, "lr": 0.5})
    backend.finish({})

    assert "loss 1.25 | lr 0.5" in buffer.getvalue()
    assert "avg" not in buffer.getvalue()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_show_the_step_of_the_total_the_time_taken_and_the_time_left(capsys):
    """Issue 36: logs that are not a terminal (SLURM files, `| tee`) showed no step/max_steps,
    elapsed time or ETA. The time left is the rate since this start's first line (start-up,
    here 30 s before it, is not a step's cost) times the steps left."""
    clock = FakeClock()
    backend = ConsoleBackend(digits=4, total_steps=1000, live=False, clock=clock)
    backend.start({}, MANIFEST)
    clock.now += 30.0  # building, loading data, the first step
    backend.log(10, {"loss": 3.0})
    clock.now += 20.0  # 10 steps in 20 s: 2 s a step
    backend.log(20, {"loss": 2.5})
    clock.now += 3600.0
    backend.log(1000, {"loss": 2.0})
    assert capsys.readouterr().out.splitlines()[1:] == [
        "step 10/1000 [0:30] | loss 3",  # no rate yet
        "step 20/1000 [0:50<32:40] | loss 2.5",  # 980 steps left at 2 s each
        "step 1000/1000 [1:00:50<0:00] | loss 2",
    ]


def test_the_plugins_line_names_each_distribution_once():
    manifest = [
        {"name": "core.data", "distribution": "forge-lm", "version": "0.1.0"},
        {"name": "core.models", "distribution": "forge-lm", "version": "0.1.0"},
        {"name": "moe", "distribution": "forge-moe", "version": "0.2.0"},
    ]
    assert plugins_line(manifest) == "forge-lm 0.1.0 (2 plugins), forge-moe 0.2.0"


def test_the_console_reader_reads_lines_with_and_without_the_total():
    out = "plugins: forge-lm 0.1.0\nstep 3/10 [0:01<0:02] | loss 1.5\nstep 4 | loss 1.25 | lr 0.01\n"
    assert read_console(Path("."), out) == [(3, {"loss": 1.5}), (4, {"loss": 1.25, "lr": 0.01})]
