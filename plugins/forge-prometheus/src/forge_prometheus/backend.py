"""The ``prometheus`` metrics backend: a run's latest metrics, served over HTTP for scraping.

Building the backend binds its listening socket, so a port that is taken stops the run before
it trains, with a :class:`~forge_lm.errors.PluginError` that names ``[metrics.prometheus] port``.
``start()`` serves the socket from a daemon thread and prints the address; ``log()`` replaces
the values a scrape returns; ``finish()`` stops the server and closes the socket.

Each metric key becomes one label-free gauge holding the last value logged for it, named by
:func:`metric_name` (``eval/loss`` -> ``forge_eval_loss``); ``forge_step`` is the step of the
last ``log()`` call. The gauges live in a registry of their own, never in prometheus_client's
global one, so a scrape returns the run's metrics and nothing else.

Values are untrusted: NaN and infinities are served as they are (Prometheus' text format has
``NaN``, ``+Inf`` and ``-Inf``), and a value that is not a real number is served as ``NaN``,
with one :class:`PrometheusBackendWarning` per metric. A key whose name is already taken by
another key (``eval/loss`` and ``eval_loss``) is not served, with one warning.
"""

from __future__ import annotations

import contextlib
import errno
import io
import numbers
import re
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from forge_lm.components import MetricsContext
from forge_lm.errors import PluginError

INSTALL_HINT = "pip install forge-prometheus"
_NOT_IN_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


class PrometheusBackendWarning(UserWarning):
    """A logged metric could not be served as it is (not a number, or a name already taken)."""


def metric_name(prefix: str, key: str) -> str:
    """The Prometheus name of metric ``key``: ``prefix`` then the key, each character that
    may not be in a name replaced by ``_`` (``eval/loss`` -> ``forge_eval_loss``)."""
    name = prefix + _NOT_IN_A_NAME.sub("_", key)
    return name if name and not name[0].isdigit() else "_" + name


def _as_number(value: Any) -> float | None:
    """``value`` as a float, or None when it is not a real number (a bool, a string, None...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except Exception:  # noqa: BLE001 - a number-like object whose float() fails is not a number
        return None


class _LatestValues:
    """The collector the registry asks at each scrape: the last value of each metric.

    ``update`` (the training thread) and ``collect`` (a server thread) share one lock, so a
    scrape sees all the metrics of one ``log()`` call or none of them.
    """

    def __init__(self, prefix: str, gauge: type) -> None:
        self._prefix = prefix
        self._gauge = gauge  # prometheus_client's GaugeMetricFamily
        self._lock = threading.Lock()
        self._step: int | None = None
        self._values: dict[str, tuple[str, float]] = {}  # name -> (key, value), in first-logged order
        self._names: dict[str, str | None] = {}  # key -> its name, None where another key holds it
        self._warned: set[str] = set()  # keys warned about for a value that is not a number

    def update(self, step: int, metrics: Mapping[Any, Any]) -> None:
        step_name = self._prefix + "step"
        with self._lock:
            for raw_key, raw_value in metrics.items():
                key = str(raw_key)
                if key not in self._names:
                    self._names[key] = self._claim(key, step_name)
                name = self._names[key]
                if name is None:
                    continue
                value = _as_number(raw_value)
                if value is None:
                    value = float("nan")
                    if key not in self._warned:
                        self._warned.add(key)
                        _warn(
                            f"metric {key!r} was logged as a value of type {type(raw_value).__name__}, not a real "
                            f"number a float can hold; {name} is NaN until it is one (this warning is not repeated)"
                        )
                self._values[name] = (key, value)
            self._step = step

    def _claim(self, key: str, step_name: str) -> str | None:
        """The name of a key logged for the first time; None, with a warning, if it is taken."""
        name = metric_name(self._prefix, key)
        holders = ["the step"] if name == step_name else [f"metric {k!r}" for k, n in self._names.items() if n == name]
        if not holders:
            return name
        _warn(f"metric {key!r} is not served: its name, {name}, already names {holders[0]}", stacklevel=5)
        return None

    def collect(self) -> Iterator[Any]:
        with self._lock:
            step, values = self._step, list(self._values.items())
        if step is None:
            return
        yield self._gauge(self._prefix + "step", "Optimizer step of the last metrics Forge logged", value=step)
        for name, (key, value) in values:
            yield self._gauge(name, f"Last value Forge logged for metric {key!r}", value=value)


# The server runs inside the training process, and anyone who can reach its port can connect:
# without these limits, each idle or half-sent connection held one thread until the run ended,
# so a few hundred of them could exhaust the threads and memory the trainer itself needs.
REQUEST_TIMEOUT_S = 10.0  # per socket read or write; a scrape takes milliseconds
# The most a whole request may take, however its bytes trickle in: a client sending one byte
# every few seconds never hits the per-read timeout, and without this held its slot for good.
REQUEST_DEADLINE_S = 10.0
MAX_CONNECTIONS = 16  # connections served at once
# When every slot is taken, a new connection takes the slot of the oldest one, if that one has
# been served this long (a real scrape takes milliseconds): slow clients cannot starve a scrape.
EVICT_AFTER_S = 1.0


class _UntilDeadline(io.RawIOBase):
    """The request's socket reader, each read given only the time left before the deadline."""

    def __init__(self, raw: Any, connection: socket.socket, seconds: float) -> None:
        super().__init__()
        self._raw, self._connection = raw, connection
        self._deadline = time.monotonic() + seconds

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request took longer than {REQUEST_DEADLINE_S:g} s")
        self._connection.settimeout(min(left, REQUEST_TIMEOUT_S))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        # Read at each connection (not a class attribute), so the constant is the one in force.
        self.timeout = REQUEST_TIMEOUT_S
        super().setup()
        self.rfile = io.BufferedReader(_UntilDeadline(self.rfile.detach(), self.connection, REQUEST_DEADLINE_S))

    def handle(self) -> None:
        # A client that stalls past the timeout, or goes away, just loses its connection: no
        # traceback on the run's standard error (the server closes the socket after this).
        with contextlib.suppress(TimeoutError, ConnectionError):
            super().handle()

    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape on the run's standard error."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never keeps the process alive
    allow_reuse_port = False  # a second run on the same port must fail, not share it
    # Connections not accepted yet wait in the kernel (no thread, no memory of the run's). With
    # socketserver's default of 5, a burst of connections beyond it is retried by the clients a
    # second later; 64 lets a burst be accepted, and each then served or closed at once.
    request_queue_size = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # One slot per connection being served: with the timeout above, at most MAX_CONNECTIONS
        # threads, each held for at most REQUEST_TIMEOUT_S per read, however many clients connect.
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._served: dict[Any, float] = {}  # connection -> when it took its slot
        self._served_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not (self._evict_oldest() and self._slots.acquire(timeout=1.0)):
            self.shutdown_request(request)  # over the cap: closed at once, no thread started
            return
        with self._served_lock:
            self._served[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:  # the thread did not start: its slot is free again (the caller closes the socket)
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # closes the connection when done
        finally:
            self._release(request)

    def _release(self, request: Any) -> None:
        with self._served_lock:
            self._served.pop(request, None)
        self._slots.release()

    def _evict_oldest(self) -> bool:
        """Cut the connection served longest, if it has had EVICT_AFTER_S: its thread's read ends
        and frees the slot. Whether one was cut."""
        with self._served_lock:
            oldest = min(self._served.items(), key=lambda item: item[1], default=None)
        if oldest is None or time.monotonic() - oldest[1] < EVICT_AFTER_S:
            return False
        with contextlib.suppress(OSError):
            oldest[0].shutdown(socket.SHUT_RDWR)
        return True


class PrometheusBackend:
    def __init__(self, options: Any, server: _Server, collector: _LatestValues) -> None:
        self.options = options
        self._server = server
        self._collector = collector
        self._thread: threading.Thread | None = None
        # Closes the socket even when start() never comes (another component failed to build).
        self._close = weakref.finalize(self, server.server_close)

    @property
    def port(self) -> int:
        """The port the server listens on (the one the system chose when ``port = 0``)."""
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        if self._thread is not None or not self._close.alive:
            return
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="forge-prometheus", kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()
        print(f"forge-prometheus: serving the run's metrics at {self.url}", file=sys.stderr, flush=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._collector.update(step, metrics)

    def finish(self, summary: Mapping[str, float]) -> None:
        if self._thread is not None:
            self._server.shutdown()  # returns once serve_forever has stopped
            self._thread.join()
            self._thread = None
        self._close()


def _warn(message: str, stacklevel: int = 4) -> None:
    """Warn where the backend's ``log()`` was called."""
    warnings.warn(message, PrometheusBackendWarning, stacklevel=stacklevel)


def _import_prometheus_client() -> tuple[type, type, Any]:
    """prometheus_client's ``CollectorRegistry``, ``GaugeMetricFamily`` and ``make_wsgi_app``."""
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.core import GaugeMetricFamily
    except ImportError as exc:
        raise PluginError(
            f"metrics backend 'prometheus' needs the prometheus-client package, which cannot be imported ({exc}). "
            f"Install it with `{INSTALL_HINT}`, or remove 'prometheus' from [metrics] backends."
        ) from None
    return CollectorRegistry, GaugeMetricFamily, make_wsgi_app


def _listen(addr: str, port: int, app: Any) -> _Server:
    """A server bound to ``addr:port``, not serving yet; a PluginError naming the option to
    change when the address cannot be had."""
    where = f"{addr}:{port}"
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise PluginError(
            f"metrics backend 'prometheus' cannot listen on {where}: {addr!r} is not an address of this machine "
            f"({exc}). Change [metrics.prometheus] addr, e.g. to '127.0.0.1' or '0.0.0.0'."
        ) from None

    class Server(_Server):
        address_family = family

    try:
        server = Server(sockaddr[:2], _QuietHandler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            problem = "the port is already in use (another run, or another program, listens on it)"
            fix = "Change [metrics.prometheus] port, or set it to 0 to take any free port (the run prints which)"
        elif exc.errno == errno.EACCES:
            problem = "permission denied (ports below 1024 need privileges)"
            fix = "Change [metrics.prometheus] port to one above 1023, or to 0 to take any free port"
        else:
            problem = exc.strerror or str(exc)
            fix = "Change [metrics.prometheus] addr (to one of this machine, like '127.0.0.1' or '0.0.0.0') or port"
        raise PluginError(f"metrics backend 'prometheus' cannot listen on {where}: {problem}. {fix}.") from None
    server.set_app(app)
    return server


def build_prometheus(options: Any, context: MetricsContext) -> PrometheusBackend:
    # Imported and bound here, not at start(), so that a missing prometheus-client or a port
    # in use stops the run before it trains. The core builds metrics backends on its main
    # process only: one server per run, however many ranks train.
    collector_registry, gauge, make_wsgi_app = _import_prometheus_client()
    collector = _LatestValues(options.prefix, gauge)
    registry = collector_registry(auto_describe=False)  # the run's own, not prometheus_client's global REGISTRY
    registry.register(collector)
    server = _listen(options.addr, options.port, make_wsgi_app(registry))
    return PrometheusBackend(options, server, collector)
