"""The bridge scores and generates as lm-eval's Hugging Face backend does on the model's
``forge export-hf``: the same requests (prompts, few-shot contexts), log-likelihoods within 1e-4,
the same greedy flags, accuracies and perplexities, and identical generated text.

Both sides run through ``lm_eval.simple_evaluate`` on the three local tasks (multiple choice,
rolling perplexity, generation with stop sequences), two-shot so that contexts exceed the tiny
model's 64-token window (left truncation, rolling windows), for a run with each tokenizer.
"""

from __future__ import annotations

import pytest
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM

from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.inference import load_for_inference
from forge_lm_eval.harness import TaskSet, metrics_of
from forge_lm_eval.lm import ForgeLM

from .conftest import ALL_TASKS, TASKS

TOLERANCE = 1e-4


def samples(lm, tasks: TaskSet) -> dict:
    results = simple_evaluate(
        model=lm, tasks=tasks.specs, task_manager=tasks.manager, num_fewshot=2, log_samples=True, bootstrap_iters=0
    )
    return results


@pytest.fixture(scope="module", params=["bytes", "hf"])
def both(request, make_run, export, tmp_path_factory):
    """``(Forge's results, the HF backend's results)`` for the run with this tokenizer."""
    run_dir = make_run(request.param)
    hf_dir = export(run_dir)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(TASKS)  # the tasks' data_files are relative to it
    try:
        tasks = TaskSet(ALL_TASKS, 64)
        model, _, tokenizer = load_for_inference(run_dir, PluginManager(PluginSettings(autoload=False)))
        ours = samples(ForgeLM(model, tokenizer, max_length=64, batch_size=3), tasks)
        # batch_size 1: the HF backend pads batched generation on the left, which changes the numbers.
        theirs = samples(HFLM(pretrained=str(hf_dir), device="cpu", batch_size=1), tasks)
    finally:
        monkeypatch.undo()
    return ours, theirs


def pairs(both, task: str):
    ours, theirs = both
    mine, reference = ours["samples"][task], theirs["samples"][task]
    assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in reference]
    assert len(mine) > 0
    return list(zip(mine, reference, strict=True))


def test_both_backends_are_given_the_same_requests(both):
    for task in ("forge_test_choice", "forge_test_complete", "forge_test_rolling"):
        for mine, reference in pairs(both, task):
            assert mine["arguments"] == reference["arguments"]


def test_loglikelihoods_and_greedy_flags_match(both):
    compared = 0
    for mine, reference in pairs(both, "forge_test_choice"):
        for (ours,), (theirs,) in zip(mine["resps"], reference["resps"], strict=True):
            assert ours[0] == pytest.approx(theirs[0], abs=TOLERANCE)
            assert ours[1] == theirs[1]
            compared += 1
    assert compared == 36  # 12 questions, 3 choices each


def test_rolling_loglikelihoods_match(both):
    for mine, reference in pairs(both, "forge_test_rolling"):
        ((ours,),), ((theirs,),) = mine["resps"], reference["resps"]
        assert ours == pytest.approx(theirs, abs=TOLERANCE)


def test_generated_text_is_identical(both):
    generated = []
    for mine, reference in pairs(both, "forge_test_complete"):
        ((ours,),), ((theirs,),) = mine["resps"], reference["resps"]
        assert ours == theirs
        generated.append(ours)
    # The outputs exercise the stop rules: some stopped early, some ran to max_gen_toks.
    assert len(set(generated)) > 1
    assert any(len(text.encode()) < 12 for text in generated) or any("\ufffd" in text for text in generated)


def test_task_metrics_are_equal(both):
    ours, theirs = both
    mine, reference = metrics_of(ours), metrics_of(theirs)
    assert mine.keys() == reference.keys()
    for name, value in reference.items():
        if name.endswith(("/acc", "/acc_norm", "/exact_match")):
            assert mine[name] == value, name
        else:
            assert mine[name] == pytest.approx(value, rel=1e-4), name
