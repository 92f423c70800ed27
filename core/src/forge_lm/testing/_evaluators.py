"""Evaluator contract: ``factory(options, context: EvaluatorContext) -> evaluator`` whose
``evaluate(model, step)`` returns a mapping of metric names to finite floats and leaves the
model as it found it (:class:`forge_lm.components.Evaluator`).

The kit builds the evaluator with an :class:`~forge_lm.components.EvaluatorContext` of a
one-process CPU run in fp32 (the ``bytes`` tokenizer, a temporary run directory, evaluation
data as a run gives it: ``validation`` and one named set, ``eval_sets["kit"]``, each two batches
of random token windows, the same every call; the aid ``context`` replaces it) and calls
``evaluate`` as the training loop does: on a tiny llama-family model of the context's
vocabulary, in eval mode, under ``torch.no_grad()``.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator, Mapping
from numbers import Real
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forge_lm.components import ReportsResults
from forge_lm.plain_data import find_not_plain
from forge_lm.testing._kit import Subject, category_check, skip_check

STEP = 10
CALLS_FOR_RESULTS = 3  # evaluate calls the results check makes, at most, for one that ran
TINY_MODEL = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64}


class KitEvalData:
    """An evaluation set as a run gives one (:class:`~forge_lm.components.EvalData`): ``steps``
    batches of random windows of ``seq_len + 1`` ids, split into inputs and next-token labels,
    the same every call."""

    def __init__(self, prefix: str, vocab_size: int, batch_size: int, seq_len: int, seed: int, steps: int = 2):
        self.prefix, self.steps = prefix, steps
        self._shape, self._vocab_size, self._seed = (batch_size, seq_len + 1), vocab_size, seed

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self._seed)
        for _ in range(self.steps):
            window = torch.randint(self._vocab_size, self._shape, generator=generator)
            ids, labels = window[:, :-1], window[:, 1:]
            yield {"input_ids": ids, "labels": labels, "document_ids": torch.zeros_like(ids)}


def _context(subject: Subject, run_dir: Path) -> Any:
    from forge_lm.components import EvaluatorContext

    given = subject.extras.get("context")
    if given is not None:
        return given
    tokenizer = subject.manager.registry.resolve("tokenizers", "bytes").build_for_run(None)
    vocab_size, batch_size, seq_len = tokenizer.vocab_size, 2, 16
    return EvaluatorContext(
        run_dir=run_dir,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        seq_len=seq_len,
        max_seq_len=TINY_MODEL["max_seq_len"],
        batch_size=batch_size,
        device=torch.device("cpu"),
        dtype=None,
        validation=KitEvalData("eval", vocab_size, batch_size, seq_len, seed=1),
        eval_sets={"kit": KitEvalData("eval/kit", vocab_size, batch_size, seq_len, seed=2)},
    )


def _model(subject: Subject, context: Any) -> nn.Module:
    from forge_lm.config import structure_config
    from forge_lm.model import build_model

    model = {**TINY_MODEL, "max_seq_len": context.max_seq_len}
    config = structure_config({"model": model, "train": {"seq_len": context.seq_len}}, subject.manager.registry)
    return build_model(config.model, context.vocab_size, subject.manager.registry, seed=0)


def _evaluated(subject: Subject) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The model (eval mode), what ``evaluate`` returned, and the model's state before the call."""
    with tempfile.TemporaryDirectory(prefix="forge-kit-evaluator-") as run_dir:
        context = _context(subject, Path(run_dir))
        evaluator = subject.build(context)
        assert callable(getattr(evaluator, "evaluate", None)), (
            f"{subject.label} returned {type(evaluator).__name__}, which has no evaluate(model, step); the kit expects "
            "a forge_lm.components.Evaluator"
        )
        model = _model(subject, context).eval()
        before = _state(model)
        with torch.no_grad():
            returned = evaluator.evaluate(model, STEP)
    return model, returned, before


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "values": {name: param.detach().clone() for name, param in model.named_parameters()},
        "dtypes": {name: param.dtype for name, param in model.named_parameters()},
        "requires_grad": {name: param.requires_grad for name, param in model.named_parameters()},
        "training": {name or "(the model)": module.training for name, module in model.named_modules()},
        "grads": {name: param.grad is not None for name, param in model.named_parameters()},
    }


@category_check("evaluators")
def check_returns_a_mapping_of_finite_floats(subject: Subject) -> None:
    """Metric names (strings) to finite numbers; a metric undefined this time is left out of the
    mapping (the run logs a NaN it gets, with a warning, but a dashboard cannot plot it)."""
    _, returned, _ = _evaluated(subject)
    assert isinstance(returned, Mapping), (
        f"{subject.label}: evaluate(model, {STEP}) returned {type(returned).__name__} {returned!r:.60}; the kit "
        "expects a mapping of metric names to floats, such as {'eval/my_task/accuracy': 0.5} ({} to skip this time)"
    )
    bad_keys = [key for key in returned if not isinstance(key, str)]
    assert not bad_keys, (
        f"{subject.label}: evaluate returned keys {bad_keys[:5]}; the kit expects metric names as strings"
    )
    not_numbers = {k: v for k, v in returned.items() if isinstance(v, bool) or not isinstance(v, Real)}
    assert not not_numbers, (
        f"{subject.label}: evaluate returned {', '.join(f'{k}={v!r:.40}' for k, v in list(not_numbers.items())[:3])}; "
        "the kit expects every value a Python number (float(tensor) for a tensor)"
    )
    undefined = {key: value for key, value in returned.items() if not math.isfinite(float(value))}
    assert not undefined, (
        f"{subject.label}: evaluate returned {', '.join(f'{k}={v}' for k, v in list(undefined.items())[:3])}; the kit "
        "expects finite values (leave a metric that is undefined this time out of the mapping)"
    )


@category_check("evaluators")
def check_leaves_the_model_as_it_found_it(subject: Subject) -> None:
    """Weights (values and dtypes), what trains, gradients and every module's train/eval mode
    are the same after ``evaluate`` as before: the run goes on training the model it handed over."""
    model, _, before = _evaluated(subject)
    after = _state(model)
    for name, dtype in before["dtypes"].items():
        now = after["dtypes"].get(name)
        assert now == dtype, (
            f"{subject.label}: after evaluate, parameter '{name}' is {now}, was {dtype}; the kit expects the weights' "
            "dtypes unchanged (cast a copy, or use torch.autocast, never model.to(dtype))"
        )
    changed = [name for name, value in before["values"].items() if not torch.equal(value, after["values"][name])]
    assert not changed, (
        f"{subject.label}: evaluate changed the values of {len(changed)} parameters ('{changed[0]}', ...); the kit "
        "expects the weights unchanged (work on a copy)"
    )
    modes = [name for name, training in before["training"].items() if after["training"].get(name) != training]
    assert not modes, (
        f"{subject.label}: after evaluate, modules {modes[:3]} are in "
        f"{'train' if after['training'][modes[0]] else 'eval'} mode ({len(modes)} of {len(before['training'])}); "
        "the kit expects the model left in the mode it was handed (eval): restore any mode you change"
    )
    frozen = [name for name, grad in before["requires_grad"].items() if after["requires_grad"][name] != grad]
    assert not frozen, f"{subject.label}: evaluate changed requires_grad of {frozen[:3]}; the kit expects it unchanged"
    grads = [name for name, had in before["grads"].items() if after["grads"][name] != had]
    assert not grads, (
        f"{subject.label}: evaluate left gradients on {grads[:3]}; the kit expects none (no backward pass through "
        "the model)"
    )


@category_check("evaluators")
def check_reported_results_are_plain_data(subject: Subject) -> None:
    """A :class:`~forge_lm.components.ReportsResults` evaluator's ``results`` after an ``evaluate``
    that ran (returned metrics; up to 3 calls, for one that runs every k-th evaluation) are a
    mapping a JSON file can hold, and its ``table`` a string (``forge eval`` writes and prints them)."""
    with tempfile.TemporaryDirectory(prefix="forge-kit-evaluator-") as run_dir:
        context = _context(subject, Path(run_dir))
        evaluator = subject.build(context)
        if not isinstance(evaluator, ReportsResults):
            skip_check(f"{subject.label} declares no results and table (ReportsResults)")
        model = _model(subject, context).eval()
        for call in range(1, CALLS_FOR_RESULTS + 1):  # an evaluator may run every k-th evaluation only
            with torch.no_grad():
                returned = evaluator.evaluate(model, STEP * call)
            if evaluator.results is not None or returned:
                break
    results, table = evaluator.results, evaluator.table
    if results is None and not returned:
        skip_check(f"{subject.label} evaluated nothing in {CALLS_FOR_RESULTS} calls (it runs every k-th evaluation)")
    assert isinstance(results, Mapping), (
        f"{subject.label}: after an evaluate that returned metrics, results is {type(results).__name__}; the kit "
        "expects a mapping of that evaluation's results"
    )
    found = find_not_plain(dict(results), non_finite=True)  # an undefined metric may be NaN
    assert found is None, (
        f"{subject.label}: results cannot be written as JSON ({found.describe('results', subscripts=True)}); the kit "
        "expects plain data (str, numbers, bools, None, lists and str-keyed mappings)"
    )
    assert isinstance(table, str), f"{subject.label}: table is {type(table).__name__}; the kit expects a str"
