"""The options of forge-prometheus's ``prometheus`` backend: the keys of ``[metrics.prometheus]``.

Named by import path in :mod:`forge_prometheus.plugin`'s registration, so that listing plugins
does not import this module (nor attrs).
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from forge_lm.validators import FieldError, between

DEFAULT_PORT = 9464  # the port OpenTelemetry's Prometheus exporters use by convention
_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _address(instance: Any, attribute: Any, value: str) -> None:
    if not value or any(character.isspace() for character in value):
        raise FieldError(
            attribute.name, f"must be a host name or IP address without spaces, like '127.0.0.1', got {value!r}"
        )


def _prefix(instance: Any, attribute: Any, value: str) -> None:
    if value and not _PREFIX.fullmatch(value):
        raise FieldError(
            attribute.name,
            "must start with a letter or '_' and hold only letters, digits and '_' (a Prometheus metric name), "
            f"or be empty, got {value!r}",
        )


@attrs.define
class PrometheusOptions:
    """The keys of ``[metrics.prometheus]``."""

    port: int = attrs.field(default=DEFAULT_PORT, validator=between(0, 65535))  # 0: any free port, printed
    addr: str = attrs.field(default="127.0.0.1", validator=_address)  # "0.0.0.0": reachable from other hosts
    prefix: str = attrs.field(default="forge_", validator=_prefix)  # put before every metric name
