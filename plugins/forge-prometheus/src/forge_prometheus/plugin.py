"""Forge plugin module of forge-prometheus (entry point group ``forge_lm``).

Registers the ``prometheus`` metrics backend (options in ``[metrics.prometheus]``). Kept free
of heavy imports: Forge imports this module to list plugins, and ``prometheus_client`` is
imported only when a run builds the backend (``forge_prometheus.backend``).
"""

from __future__ import annotations

from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1.2,<2"  # 1.2: options classes named by import path


@hookimpl
def forge_lm_register_metrics_backends(register):
    register(
        "prometheus",
        "forge_prometheus.backend:build_prometheus",
        config="forge_prometheus.options:PrometheusOptions",
        description="Prometheus: serves the latest value of each metric over HTTP for scraping, on rank 0",
    )
