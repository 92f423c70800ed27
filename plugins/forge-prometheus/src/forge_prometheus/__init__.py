"""forge-prometheus: a Prometheus metrics backend for Forge."""
