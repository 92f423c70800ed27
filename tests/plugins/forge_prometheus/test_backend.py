"""The prometheus backend on its own: the conformance kit, what a scrape returns (exact values,
names, NaN and infinities, values that are not numbers), its own registry, the server's life
(port 0, finish), its options, and a port in use."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import select
import socket
import threading
import time
import urllib.error
import warnings
from collections.abc import Mapping

import prometheus_client
import pytest

from forge_lm.config import load_config
from forge_lm.errors import ConfigError, PluginError
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import parametrize_with_checks
from forge_prometheus import backend as backend_module
from forge_prometheus.backend import PrometheusBackend, PrometheusBackendWarning, metric_name
from forge_prometheus.options import PrometheusOptions

SCRAPED: list[tuple[int, dict[str, float]]] = []  # (step, what a scrape returned right after log(step))


def read_back(run_dir, output):
    """The kit's logged steps as scraped: metric names back to keys (the default prefix off)."""
    recorded = [
        (step, {name.removeprefix("forge_"): value for name, value in values.items() if name != "forge_step"})
        for step, values in SCRAPED
    ]
    SCRAPED.clear()
    return recorded


@pytest.fixture
def scraped_after_each_log(monkeypatch, scrape):
    """Each log() of any prometheus backend is followed by a scrape of its server, into SCRAPED."""
    log = PrometheusBackend.log

    def log_then_scrape(self, step, metrics):
        log(self, step, metrics)
        values = scrape(self.url)
        assert values["forge_step"] == step
        SCRAPED.append((step, values))

    SCRAPED.clear()
    monkeypatch.setattr(PrometheusBackend, "log", log_then_scrape)


@parametrize_with_checks(
    components=[("metrics_backends", "prometheus", {"options": {"port": 0}, "read_back": read_back})],
    manager=PluginManager(PluginSettings(autoload=False, allow=("prometheus",))),
)
def test_prometheus_backend_passes_the_metrics_backend_conformance_checks(check, scraped_after_each_log):
    check()


def test_a_scrape_returns_each_logged_metric_as_a_gauge_with_its_exact_value(build_backend, scrape, scrape_raw):
    backend = build_backend()
    backend.start({}, [])
    metrics = {
        "loss": 2.718281828459045,
        "lr": 3e-4,
        "grad_norm": 0.1 + 0.2,  # 0.30000000000000004: every digit must survive
        "eval/loss": 1.5,
        "memory/rss_gib": 12.345678901234567,
        "tokens_per_sec": 123456789.0,
    }
    backend.log(7, metrics)

    assert scrape(backend.url) == {
        "forge_step": 7.0,
        "forge_loss": 2.718281828459045,
        "forge_lr": 3e-4,
        "forge_grad_norm": 0.30000000000000004,
        "forge_eval_loss": 1.5,
        "forge_memory_rss_gib": 12.345678901234567,
        "forge_tokens_per_sec": 123456789.0,
    }
    text = scrape_raw(backend.url)
    assert "# TYPE forge_eval_loss gauge\n" in text
    assert "# HELP forge_eval_loss Last value Forge logged for metric 'eval/loss'\n" in text


def test_each_log_replaces_the_values_and_a_metric_not_logged_again_keeps_its_last_value(build_backend, scrape):
    backend = build_backend()
    backend.start({}, [])
    backend.log(3, {"loss": 3.0, "eval/loss": 2.5})
    backend.log(4, {"loss": 2.0})

    assert scrape(backend.url) == {"forge_step": 4.0, "forge_loss": 2.0, "forge_eval_loss": 2.5}


def test_nothing_is_served_before_the_first_log(build_backend, scrape_raw):
    backend = build_backend()
    backend.start({}, [])

    assert scrape_raw(backend.url) == ""


class MetricsThatScrapeWhileRead(Mapping):
    """Metrics whose reading, half-way, scrapes the server from another thread and lets it try
    for half a second: the scrape must wait for the whole step to be recorded."""

    def __init__(self, values: dict, scrape_in_a_thread) -> None:
        self.values, self.scrape_in_a_thread = values, scrape_in_a_thread
        self.scraper: threading.Thread | None = None

    def __getitem__(self, key):
        return self.values[key]

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        for index, key in enumerate(self.values):
            if index == 1:
                self.scraper = self.scrape_in_a_thread()
                self.scraper.join(timeout=0.5)
            yield key


def test_a_scrape_during_a_log_waits_for_every_value_of_its_step(build_backend, scrape):
    backend = build_backend()
    backend.start({}, [])
    backend.log(1, {"loss": 3.0, "lr": 1e-3, "grad_norm": 1.0})
    answers = []

    def scrape_in_a_thread():
        thread = threading.Thread(target=lambda: answers.append(scrape(backend.url)))
        thread.start()
        return thread

    metrics = MetricsThatScrapeWhileRead({"loss": 2.0, "lr": 5e-4, "grad_norm": 0.5}, scrape_in_a_thread)
    backend.log(2, metrics)
    metrics.scraper.join(timeout=10)

    assert answers == [{"forge_step": 2.0, "forge_loss": 2.0, "forge_lr": 5e-4, "forge_grad_norm": 0.5}]


def test_nan_and_infinities_are_served_as_prometheus_writes_them(build_backend, scrape, scrape_raw):
    backend = build_backend()
    backend.start({}, [])
    backend.log(2, {"loss": float("nan"), "grad_norm": float("inf"), "z_loss": float("-inf"), "lr": 1e-3})

    text = scrape_raw(backend.url)
    assert "forge_loss NaN\n" in text
    assert "forge_grad_norm +Inf\n" in text
    assert "forge_z_loss -Inf\n" in text
    values = scrape(backend.url)
    assert math.isnan(values["forge_loss"])
    assert values["forge_grad_norm"] == math.inf
    assert values["forge_z_loss"] == -math.inf
    assert values["forge_lr"] == 1e-3


def test_a_value_that_is_not_a_number_is_served_as_nan_with_one_warning_per_metric(build_backend, scrape):
    backend = build_backend()
    backend.start({}, [])
    odd = {"note": "fast", "missing": None, "list": [1.0], "flag": True, "huge": 10**400, "complex": 1j}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a warning repeated would be seen
        backend.log(1, {"loss": 2.0, **odd})
        backend.log(2, {"loss": 1.5, **odd})  # the same metrics again: no second warning

    assert {w.category for w in caught} == {PrometheusBackendWarning}
    assert sorted(str(w.message).split("'")[1] for w in caught) == sorted(odd)
    assert "metric 'note' was logged as a value of type str, not a real number" in str(caught[0].message)
    values = scrape(backend.url)
    assert (values["forge_step"], values["forge_loss"]) == (2.0, 1.5)
    assert all(math.isnan(values[f"forge_{key}"]) for key in odd)

    backend.log(3, {"note": 4.0})  # a number again: served as it is
    assert scrape(backend.url)["forge_note"] == 4.0


def test_metric_names_are_sanitized_and_a_name_already_taken_is_not_served(build_backend, scrape):
    assert metric_name("forge_", "eval/loss") == "forge_eval_loss"
    assert metric_name("forge_", "memory/rss_gib") == "forge_memory_rss_gib"
    assert metric_name("forge_", "moe/layer.3-load ratio") == "forge_moe_layer_3_load_ratio"
    assert metric_name("", "2nd/loss") == "_2nd_loss"  # a name may not start with a digit
    backend = build_backend()
    backend.start({}, [])

    with pytest.warns(PrometheusBackendWarning) as caught:
        backend.log(5, {"eval/loss": 1.25, "eval_loss": 9.0, "step": 99.0})

    assert sorted(str(w.message) for w in caught) == [
        "metric 'eval_loss' is not served: its name, forge_eval_loss, already names metric 'eval/loss'",
        "metric 'step' is not served: its name, forge_step, already names the step",
    ]
    assert scrape(backend.url) == {"forge_step": 5.0, "forge_eval_loss": 1.25}


def test_the_prefix_option_names_every_metric_and_may_be_empty(build_backend, scrape):
    custom, bare = build_backend(prefix="llm_"), build_backend(prefix="")
    for backend in (custom, bare):
        backend.start({}, [])
        backend.log(1, {"eval/loss": 2.0})

    assert scrape(custom.url) == {"llm_step": 1.0, "llm_eval_loss": 2.0}
    assert scrape(bare.url) == {"step": 1.0, "eval_loss": 2.0}


def test_the_run_has_a_registry_of_its_own_not_the_global_one(build_backend, scrape):
    backend = build_backend()
    backend.start({}, [])
    backend.log(1, {"loss": 2.0})

    assert set(scrape(backend.url)) == {"forge_step", "forge_loss"}  # no process_* nor python_* collectors
    global_names = {family.name for family in prometheus_client.REGISTRY.collect()}
    assert not {name for name in global_names if name.startswith("forge_")}


def test_defaults_are_port_9464_on_the_loopback_address_with_the_forge_prefix():
    assert PrometheusOptions() == PrometheusOptions(port=9464, addr="127.0.0.1", prefix="forge_")


def test_port_0_takes_a_free_port_on_the_loopback_address_and_start_prints_the_url(build_backend, scrape, capsys):
    backend = build_backend()
    host, port = backend._server.server_address[:2]
    assert (host, port == 0) == ("127.0.0.1", False)

    backend.start({}, [])
    backend.log(1, {"loss": 2.0})

    url = f"http://127.0.0.1:{port}/metrics"
    assert backend.url == url
    assert capsys.readouterr().err == f"forge-prometheus: serving the run's metrics at {url}\n"
    assert scrape(url)["forge_loss"] == 2.0


def test_addr_0_0_0_0_listens_on_every_interface(build_backend, scrape):
    backend = build_backend(addr="0.0.0.0")
    backend.start({}, [])
    backend.log(1, {"loss": 2.0})

    assert backend._server.server_address[0] == "0.0.0.0"
    assert scrape(f"http://127.0.0.1:{backend.port}/metrics")["forge_loss"] == 2.0


def test_finish_stops_the_server_and_frees_the_port(build_backend, scrape):
    backend = build_backend()
    backend.start({}, [])
    backend.log(1, {"loss": 2.0})
    assert scrape(backend.url)["forge_loss"] == 2.0

    backend.finish({"final_loss": 2.0})

    with pytest.raises(urllib.error.URLError) as refused:
        scrape(backend.url)
    assert isinstance(refused.value.reason, ConnectionRefusedError)
    again = build_backend(port=backend.port)  # the port can be had again at once
    again.start({}, [])
    again.log(1, {"loss": 1.0})
    assert scrape(again.url)["forge_loss"] == 1.0


def test_finish_without_start_closes_the_socket(build_backend):
    backend = build_backend()

    backend.finish({})

    build_backend(port=backend.port).finish({})


def test_idle_connections_hold_a_bounded_number_of_threads_and_time_out(build_backend, scrape, monkeypatch):
    cap, clients = 4, 50
    monkeypatch.setattr(backend_module, "MAX_CONNECTIONS", cap)
    monkeypatch.setattr(backend_module, "REQUEST_TIMEOUT_S", 0.5)
    backend = build_backend()
    backend.start({}, [])
    backend.log(3, {"loss": 2.0})
    baseline = threading.active_count()

    peak = baseline
    idle: list[socket.socket] = []
    try:
        for _ in range(clients):  # a request line, then nothing: the server waits for the headers
            client = socket.create_connection(("127.0.0.1", backend.port), timeout=5)
            client.sendall(b"GET /metrics HTTP/1.1\r\n")
            idle.append(client)
            peak = max(peak, threading.active_count())

        # The server closes every one of them: over the cap at once, the others at the timeout.
        open_ = list(idle)
        deadline = time.monotonic() + 10
        while open_ and time.monotonic() < deadline:
            peak = max(peak, threading.active_count())
            readable, _, _ = select.select(open_, [], [], 0.05)
            for client in readable:
                try:
                    data = client.recv(4096)
                except ConnectionError:
                    data = b""
                if not data:
                    open_.remove(client)
        assert peak - baseline <= cap + 1, f"{peak - baseline} server threads for {clients} idle connections"
        assert not open_, f"{len(open_)} of {clients} idle connections still open after 10 s"
    finally:
        for client in idle:
            client.close()

    deadline = time.monotonic() + 5
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == baseline
    assert scrape(backend.url) == {"forge_step": 3.0, "forge_loss": 2.0}


def test_a_port_in_use_is_a_plugin_error_naming_the_option_to_change(build_backend):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        with pytest.raises(PluginError) as caught:
            build_backend(port=port)

    assert str(caught.value) == (
        f"metrics backend 'prometheus' cannot listen on 127.0.0.1:{port}: the port is already in use (another run, "
        "or another program, listens on it). Change [metrics.prometheus] port, or set it to 0 to take any free port "
        "(the run prints which)."
    )


def test_a_second_run_on_the_same_port_is_refused_while_the_first_serves(build_backend):
    first = build_backend()
    first.start({}, [])

    with pytest.raises(PluginError, match=r"already in use.*Change \[metrics\.prometheus\] port"):
        build_backend(port=first.port)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (
            errno.EACCES,
            "cannot listen on 127.0.0.1:80: permission denied (ports below 1024 need privileges). Change "
            "[metrics.prometheus] port to one above 1023, or to 0 to take any free port.",
        ),
        (
            errno.EADDRNOTAVAIL,
            "cannot listen on 127.0.0.1:80: Cannot assign requested address. Change [metrics.prometheus] addr (to "
            "one of this machine, like '127.0.0.1' or '0.0.0.0') or port.",
        ),
    ],
)
def test_other_bind_failures_name_the_option_to_change(build_backend, monkeypatch, code, message):
    def refuse(server):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(backend_module._Server, "server_bind", refuse)

    with pytest.raises(PluginError) as caught:
        build_backend(port=80)
    assert str(caught.value) == f"metrics backend 'prometheus' {message}"


def test_an_address_that_is_not_this_machines_names_the_addr_option(build_backend):
    with pytest.raises(PluginError, match=r"'no-such-host\.invalid' is not an address.*\[metrics\.prometheus\] addr"):
        build_backend(addr="no-such-host.invalid")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--metrics.prometheus.port=65536", "[metrics.prometheus] port: must be between 0 and 65535, got 65536"),
        ("--metrics.prometheus.port=-1", "[metrics.prometheus] port: must be between 0 and 65535, got -1"),
        ("--metrics.prometheus.addr=", "[metrics.prometheus] addr: must be a host name or IP address"),
        ("--metrics.prometheus.addr=local host", "[metrics.prometheus] addr: must be a host name or IP address"),
        ("--metrics.prometheus.prefix=2forge_", "[metrics.prometheus] prefix: must start with a letter or '_'"),
        ("--metrics.prometheus.prefix=forge-", "[metrics.prometheus] prefix: must start with a letter or '_'"),
    ],
)
def test_invalid_options_are_refused_naming_section_and_key(prometheus_manager, override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, ['--metrics.backends=["prometheus"]', override], prometheus_manager.registry)
    assert message in str(caught.value)


def test_slow_clients_in_every_slot_neither_hold_it_past_the_deadline_nor_starve_a_scrape(
    build_backend, scrape, monkeypatch
):
    # Issue 37: one client per slot sending a byte at a time, each before the read timeout,
    # held every slot for good and no scrape was answered.
    cap = 4
    monkeypatch.setattr(backend_module, "MAX_CONNECTIONS", cap)
    monkeypatch.setattr(backend_module, "REQUEST_TIMEOUT_S", 5.0)
    monkeypatch.setattr(backend_module, "REQUEST_DEADLINE_S", 2.0)
    monkeypatch.setattr(backend_module, "EVICT_AFTER_S", 0.5)
    backend = build_backend()
    backend.start({}, [])
    backend.log(3, {"loss": 2.0})

    slow = [socket.create_connection(("127.0.0.1", backend.port), timeout=5) for _ in range(cap)]
    cut: set[int] = set()  # which slow clients the server closed
    try:
        started = time.monotonic()
        while time.monotonic() - started < 0.8:  # every slot busy with a trickle, each well inside the read timeout
            for client in slow:
                with contextlib.suppress(OSError):
                    client.sendall(b"G")
            time.sleep(0.1)
        assert scrape(backend.url) == {"forge_step": 3.0, "forge_loss": 2.0}  # it takes the oldest one's slot

        while len(cut) < cap and time.monotonic() - started < 6.0:  # trickle on: each is cut by its deadline
            for index, client in enumerate(slow):
                try:
                    client.sendall(b"E")
                    readable, _, _ = select.select([client], [], [], 0)
                    if readable and not client.recv(4096):
                        cut.add(index)
                except OSError:
                    cut.add(index)
            time.sleep(0.1)
        assert len(cut) == cap, f"{cap - len(cut)} of {cap} trickling clients still served after 6 s"
    finally:
        for client in slow:
            client.close()
