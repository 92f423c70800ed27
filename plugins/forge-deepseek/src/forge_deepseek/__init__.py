"""forge-deepseek: multi-head latent attention and the DeepSeek-V3 model family for Forge."""
