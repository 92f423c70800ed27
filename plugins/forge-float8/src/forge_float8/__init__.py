"""forge-float8: float8 training of a Forge model's linear layers, with torchao."""
