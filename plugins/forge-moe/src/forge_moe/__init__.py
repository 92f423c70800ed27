"""forge-moe: mixture-of-experts layers, routers and expert parallelism for Forge."""
