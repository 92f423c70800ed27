"""`forge train` with the prometheus backend beside console and jsonl, scraped while it trains.

A small plugin of the test scrapes the server from ``forge_lm_step_end``: inside the training
loop, after the step's update and before the core logs that step, so each scrape shows the
step logged before it. What it scraped is compared with what the core wrote to metrics.jsonl.
"""

from __future__ import annotations

import re
import socket
import urllib.error
from pathlib import Path

import pytest

from forge_lm import hookimpl
from forge_lm.cli._main import main
from forge_lm.config import load_config
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import torchrun
from forge_lm.train import train
from forge_prometheus.backend import metric_name

README = Path(__file__).resolve().parents[3] / "plugins" / "forge-prometheus" / "README.md"
TINY = (
    *TINY_MODEL,
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--train.max_steps=6",
    "--metrics.log_interval=1",
    '--metrics.backends=["console", "jsonl", "prometheus"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=3",
    "--eval.steps=1",
    "--checkpoint.interval=0",
    "--data.name=synthetic",
)


class Scraper:
    """Scrapes the run's server at the end of every step; finds its URL where the run printed it."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, capsys, scrape) -> None:
        self.capsys, self.scrape = capsys, scrape
        self.url: str | None = None
        self.scrapes: dict[int, dict[str, float]] = {}  # step_end's step -> what the server answered

    @hookimpl
    def forge_lm_step_end(self, context, step, metrics):
        if self.url is None:
            printed = self.capsys.readouterr().err
            self.url = re.search(r"forge-prometheus: serving the run's metrics at (http://\S+)\n", printed).group(1)
        self.scrapes[step] = self.scrape(self.url)
        return {}


def by_step(records: list[dict]) -> dict[int, dict]:
    """metrics.jsonl's records merged per step (training and evaluation metrics share a step)."""
    merged: dict[int, dict] = {}
    for record in records:
        step = record.pop("step")
        merged.setdefault(step, {}).update(record)
    return merged


def test_a_scrape_during_training_returns_what_the_run_logged_for_the_last_logged_step(
    tmp_path, capsys, scrape, parse_exposition
):
    manager = PluginManager(PluginSettings(autoload=False, allow=("prometheus",)))
    scraper = Scraper(capsys, scrape)
    manager.add_plugin(scraper, "scraper")
    run_dir = tmp_path / "run"
    config = load_config(
        None, [*TINY, "--metrics.prometheus.port=0", f"--train.output_dir={run_dir}"], manager.registry
    )

    result = train(config, manager)

    assert result.status == "completed"
    logged = by_step(read_metrics(run_dir / "metrics.jsonl"))
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert "eval/loss" in logged[3]
    assert sorted(scraper.scrapes) == [1, 2, 3, 4, 5, 6]
    assert scraper.scrapes[1] == {}  # step 1 is not logged yet when its step_end runs
    last_eval = {}
    for step in range(2, 7):
        scraped, expected = scraper.scrapes[step], logged[step - 1]
        last_eval.update({key: value for key, value in expected.items() if key.startswith("eval/")})
        assert scraped["forge_step"] == step - 1
        assert scraped["forge_loss"] == expected["loss"]  # the exact float the run logged, not a rounding
        served = {metric_name("forge_", key): value for key, value in {**expected, **last_eval}.items()}
        assert scraped == {"forge_step": step - 1, **served}
    assert scraper.scrapes[4]["forge_eval_loss"] == logged[3]["eval/loss"]
    # The README's scrape, taken just after an evaluation, shows these metrics, in this order.
    readme_scrape = re.search(r"\n```\n(# HELP forge_step .*?)```", README.read_text(), flags=re.DOTALL).group(1)
    assert list(scraper.scrapes[4]) == list(parse_exposition(readme_scrape))

    with pytest.raises(urllib.error.URLError) as refused:  # the run is over: so is its server
        scrape(scraper.url)
    assert isinstance(refused.value.reason, ConnectionRefusedError)


def test_forge_train_with_the_port_in_use_stops_before_training_with_a_clear_error(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        code = main(["train", *TINY, f"--metrics.prometheus.port={port}", f"--train.output_dir={run_dir}"])

    assert code == 2
    err = capsys.readouterr().err
    assert (
        f"forge: error: metrics backend 'prometheus' cannot listen on 127.0.0.1:{port}: the port is already in use"
        in err
    )
    assert "Change [metrics.prometheus] port, or set it to 0 to take any free port" in err
    assert "Traceback" not in err
    assert not run_dir.exists()  # stopped before the run directory was written


class Interrupter:
    """Scrapes at the end of step 3, then stops the run as Ctrl-C would."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self, capsys, scrape) -> None:
        self.scraper = Scraper(capsys, scrape)

    @hookimpl
    def forge_lm_step_end(self, context, step, metrics):
        self.scraper.forge_lm_step_end(context, step, metrics)
        if step == 3:
            raise KeyboardInterrupt
        return {}


def test_a_run_that_does_not_complete_stops_its_server_too(tmp_path, capsys, scrape):
    manager = PluginManager(PluginSettings(autoload=False, allow=("prometheus",)))
    interrupter = Interrupter(capsys, scrape)
    manager.add_plugin(interrupter, "interrupter")
    overrides = ["--metrics.prometheus.port=0", "--eval.interval=0", f"--train.output_dir={tmp_path / 'run'}"]
    config = load_config(None, [*TINY, *overrides], manager.registry)

    with pytest.raises(KeyboardInterrupt):
        train(config, manager)

    scraper = interrupter.scraper
    assert scraper.scrapes[3]["forge_step"] == 2  # it served while the run trained
    with pytest.raises(urllib.error.URLError) as refused:
        scrape(scraper.url)
    assert isinstance(refused.value.reason, ConnectionRefusedError)


def test_a_run_on_two_processes_serves_once_from_rank_0(tmp_path):
    with socket.socket() as probe:  # a port free now; a second server on it would fail to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    overrides = [
        "--train.max_steps=2",
        "--eval.interval=0",
        f"--metrics.prometheus.port={port}",
        f"--train.output_dir={tmp_path / 'run'}",
    ]

    done = torchrun(["-m", "forge_lm", "train", *TINY, *overrides], nproc=2, timeout=300)

    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 ranks" in done.stderr
    served = re.findall(r"forge-prometheus: serving the run's metrics at (\S+)", done.stderr)
    assert served == [f"http://127.0.0.1:{port}/metrics"]
