"""forge-wandb: a Weights & Biases metrics backend for Forge."""
