"""forge-vlm: vision-language models for Forge (a ViT tower joined to any language family)."""
