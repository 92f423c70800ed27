"""One short real run under the retention rules: a checkpoint and an evaluation every step; the
directories left are worked out from the logged eval losses, not from the rule's code."""

from __future__ import annotations

import json

from forge_lm.config import load_config
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.train import train

from .conftest import TINY


def test_a_run_keeps_exactly_the_steps_its_rules_name(tmp_path, manager):
    path = tmp_path / "run.toml"
    path.write_text(
        "[checkpoint]\ninterval = 1\nkeep_last_n = 1\nkeep_best_n = 1\n"
        "[[checkpoint.keep]]\nuntil_step = 3\nevery = 2\n[[checkpoint.keep]]\nevery = 5\n"
    )
    run_dir = tmp_path / "run"
    config = load_config(
        path,
        [*TINY, "--train.max_steps=7", "--eval.interval=1", "--eval.steps=1", f"--train.output_dir={run_dir}"],
        manager.registry,
    )
    assert train(config, manager).status == "completed"
    eval_loss = {r["step"]: r["eval/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval/loss" in r}
    assert sorted(eval_loss) == list(range(1, 8))
    best = min(eval_loss, key=lambda step: (eval_loss[step], -step))  # lowest; a tie goes to the newer step
    # 7: the newest (and latest); 2: every 2 up to step 3; 5: every 5 after that; and the best.
    expected = {7, 2, 5, best}
    left = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert left == sorted(f"step_{s}" for s in expected)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_7"
    for step in expected:
        saved = json.loads((run_dir / "checkpoints" / f"step_{step}" / "eval_metrics.json").read_text())
        assert saved["eval/loss"] == eval_loss[step]
