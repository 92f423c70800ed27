"""The ``lm_eval`` evaluator: lm-eval tasks on the live model at a run's evaluations, and on a
checkpoint for ``forge eval``."""

from __future__ import annotations

import contextlib
import io
from typing import Any

from forge_lm_eval.harness import TaskSet, metrics_of, results_table, run_tasks
from forge_lm_eval.lm import ForgeLM


class LmEvalEvaluator:
    """Runs ``options.tasks`` through lm-eval on every ``options.every``-th evaluation.

    After an evaluation that ran, :attr:`results` holds lm-eval's results (JSON data) and
    :attr:`table` its text table; ``forge eval`` prints the one and writes the other.
    """

    def __init__(self, options: Any, context: Any) -> None:
        self.options, self.context = options, context
        with self._quiet():
            self.tasks = TaskSet(options.tasks, context.max_seq_len, options.include_path)
        self.evaluations = 0  # evaluations this process has seen: every-th counts them
        self.results: dict[str, Any] | None = None
        self.table = ""

    def evaluate(self, model: Any, step: int) -> dict[str, float]:
        self.evaluations += 1
        if self.evaluations % self.options.every:
            return {}
        lm = ForgeLM(
            model,
            self.context.tokenizer,
            max_length=self.context.max_seq_len,
            batch_size=self.options.batch_size or self.context.batch_size,
            device=self.context.device,
            dtype=self.context.dtype,
        )
        with self._quiet():
            results = run_tasks(lm, self.tasks, limit=self.options.limit, num_fewshot=self.options.num_fewshot)
        if results is None:  # lm-eval hands its results to one process per host; rank 0 has them
            return {}
        self.results, self.table = results, results_table(results)
        return metrics_of(results)

    def _quiet(self) -> contextlib.AbstractContextManager:
        """Every rank does the same work: lm-eval's progress bars and warnings are shown once,
        by rank 0 (an error still propagates as an exception on every rank)."""
        return contextlib.redirect_stderr(io.StringIO()) if self.context.rank else contextlib.nullcontext()


def build_lm_eval(options: Any, context: Any) -> LmEvalEvaluator:
    return LmEvalEvaluator(options, context)
