"""forge-lm-eval: EleutherAI's lm-evaluation-harness for Forge models."""
