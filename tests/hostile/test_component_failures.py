"""Hostile components: a plugin's optimizer, scheduler, dataset, feed-forward layer, model family,
router or evaluator that raises, ends, returns garbage or silently breaks the run mid-training.

Each case installs the plugin ``hostile`` (distribution ``forge-hostile`` 1.0, as in
``test_plugins.py``) with one broken component, and trains 4 steps with a checkpoint every 2.
The plugin's ``step_end`` hook keeps the number of steps done in ``STEP``, so that a component
breaks at a chosen step. What Forge owes each: the plugin-failure path (exit 4, the component,
plugin, distribution and version named, the last good step checkpointed; a half-done optimizer
or scheduler step is not), documented in ``forge_lm.hookspecs`` and ``forge_lm.train.guards``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _hostile import Case, Outcome, Workspace, case_params
from test_plugins import TRAIN, install, nothing_saved, plugin_site, records, stopped_at

__all__ = ["plugin_site"]  # the fixture, shared with test_plugins.py

PLUGIN = r"plugin 'hostile' \(forge-hostile 1\.0\)"
SAVED_3 = r"Training stopped at step 3 after saving a checkpoint of that step, which is intact\."
STEP_2_INTACT = r"Training stopped at step 2; the newest checkpoint \(step_2\) is intact\."

# Counts the steps done: a component reads STEP[0] to break at a chosen step.
COUNTER = """
import math, os, sys
import torch

STEP = [0]

def fail(error):
    raise error

@hookimpl
def forge_lm_step_end(step):
    STEP[0] = step
"""


def with_component(body: str):
    return lambda ws: install(ws, COUNTER + body)


def optimizer(action: str):
    """An SGD whose step() does ``action`` (one statement) from step 3 on."""
    return with_component(
        f"""
class Optimizer(torch.optim.SGD):
    def step(self, closure=None):
        if STEP[0] >= 2:
            {action}
        return super().step(closure)

@hookimpl
def forge_lm_register_optimizers(register):
    register("hostile_opt", lambda options, model: Optimizer(model.parameters(), lr=0.01), description="x")
"""
    )


def schedule(factor: str):
    """A LambdaLR whose factor at scheduler step ``s`` is ``factor``."""
    return with_component(
        f"""
def factor(s):
    return {factor}

@hookimpl
def forge_lm_register_schedulers(register):
    register("hostile_sched", lambda options, opt, total: torch.optim.lr_scheduler.LambdaLR(opt, factor),
             description="x")
"""
    )


def dataset(spoil: str, iterate: str = "yield self.sample(index)"):
    """Synthetic samples; sample ``index`` passes through ``spoil`` (an expression of ``sample``
    and ``index``: from index 6 on, batch 4, read after step 3)."""
    return with_component(
        f"""
from forge_lm.data.synthetic import SyntheticTokens

class Data(SyntheticTokens):
    def sample(self, index):
        sample = super().sample(index)
        return sample if index < 6 else {spoil}

    def __iter__(self):
        while True:
            index = self._start
            self._start += 1
            {iterate}

@hookimpl
def forge_lm_register_datasets(register):
    register("hostile_data", lambda options, context: Data(context), description="x")
"""
    )


def feed_forward(returns: str):
    """A linear feed-forward layer returning ``returns`` (of ``out`` and ``x``) from step 3 on."""
    return with_component(
        f"""
class FeedForward(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = torch.nn.Linear(dim, dim)

    def forward(self, x):
        out = self.w(x)
        return out if STEP[0] < 2 else {returns}

@hookimpl
def forge_lm_register_feed_forwards(register):
    register("hostile_ffn", lambda options, dim, layer_index: FeedForward(dim), description="x")
"""
    )


def router(spoil: str):
    """forge-moe's softmax top-k router, its Routing ``r`` replaced by ``spoil`` from step 3 on."""
    return with_component(
        f"""
from forge_moe.routers import Routing, SoftmaxTopKRouter

class Router(SoftmaxTopKRouter):
    def forward(self, x):
        r = super().forward(x)
        return r if STEP[0] < 2 else {spoil}

@hookimpl
def forge_lm_register_routers(register):
    register("hostile_router", lambda options, dim, n, k: Router(dim, n, k), description="x")
"""
    )


def evaluator(body: str):
    return with_component(
        f"""
class Evaluator:
    def evaluate(self, model, step):
        {body}

@hookimpl
def forge_lm_register_evaluators(register):
    register("hostile_eval", lambda options, context: Evaluator(), description="x")
"""
    )


FAMILY = """
from forge_lm.config import LlamaOptions
from forge_lm.model.transformer import Transformer, build_llama

class Family(Transformer):
    def forward(self, *args, **kwargs):
        if STEP[0] >= 2:
            raise RuntimeError("kaput")
        return super().forward(*args, **kwargs)

def build(options, context):
    model = build_llama(options, context)
    model.__class__ = Family
    return model

@hookimpl
def forge_lm_register_models(register):
    register("hostile_family", build, config=LlamaOptions, description="x")
"""

WITH_OPT = (*TRAIN, "--optimizer.name=hostile_opt")
WITH_SCHED = (*TRAIN, "--scheduler.name=hostile_sched")
WITH_DATA = (*TRAIN, "--data.name=hostile_data")
WITH_FFN = (*TRAIN, "--model.ffn.name=hostile_ffn")
WITH_ROUTER = (
    *TRAIN,
    "--model.ffn.name=moe",
    "--model.ffn.n_experts=4",
    "--model.ffn.top_k=2",
    "--model.ffn.router.name=hostile_router",
)
WITH_EVAL = (*TRAIN, "--eval.interval=3", "--eval.steps=1", '--eval.evaluators=["hostile_eval"]')


def without(fix: str) -> str:
    return rf"Fix the plugin or run without it \({fix}\), then run the same command to resume\.$"


OPT_UNSAVED = (
    r"Training stopped at step 2 and saved nothing \(its step\(\) may have updated part of the weights\); the "
    r"newest checkpoint \(step_2\) is intact\. " + without(r"set another \[optimizer\] name")
)


def no_step_after(step: int):
    def check(ws: Workspace, outcome: Outcome) -> None:
        assert max(r["step"] for r in records(ws) if "loss" in r) == step

    return check


CASES = [
    # -- optimizer: step() raising, out of memory, exiting, interrupting: nothing saved half-stepped ---
    Case(
        "optimizer-step-raises",
        WITH_OPT,
        4,
        rf"forge: error: optimizer 'hostile_opt' of {PLUGIN} raised in step\(\) at step 3: RuntimeError: boom\. "
        + OPT_UNSAVED,
        setup=optimizer("raise RuntimeError('boom')"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "optimizer-step-out-of-memory",
        WITH_OPT,
        4,
        rf"forge: error: optimizer 'hostile_opt' of {PLUGIN} raised in step\(\) at step 3: OutOfMemoryError: CUDA "
        r"out of memory\. Tried to allocate 2\.00 GiB\. Training stopped at step 2 and saved nothing",
        setup=optimizer("raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "optimizer-step-calls-sys-exit-0",
        WITH_OPT,
        4,
        rf"forge: error: optimizer 'hostile_opt' of {PLUGIN} raised in step\(\) at step 3: SystemExit: 0\. ",
        setup=optimizer("sys.exit(0)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "optimizer-step-raises-keyboard-interrupt",
        WITH_OPT,
        4,
        rf"forge: error: optimizer 'hostile_opt' of {PLUGIN} raised in step\(\) at step 3: KeyboardInterrupt\. ",
        setup=optimizer("raise KeyboardInterrupt"),
        check=stopped_at(2, [1, 2]),
    ),
    # -- scheduler: its lambda raising, returning a string, making the rate negative -----------------
    Case(
        "scheduler-lambda-raises",
        WITH_SCHED,
        4,
        rf"forge: error: scheduler 'hostile_sched' of {PLUGIN} raised in step\(\) at step 3: ZeroDivisionError: "
        r"division by zero\. Training stopped at step 2 and saved nothing \(the optimizer had stepped, the "
        r"schedule had not\); the newest checkpoint \(step_2\) is intact\. "
        + without(r"set another \[scheduler\] name"),
        setup=schedule("1 / 0 if s >= 3 else 1.0"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "scheduler-lambda-returns-a-string",
        WITH_SCHED,
        4,
        rf"forge: error: scheduler 'hostile_sched' of {PLUGIN} raised in step\(\) at step 3: TypeError: can't "
        r"multiply sequence",
        setup=schedule("'fast' if s >= 3 else 1.0"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "scheduler-makes-the-rate-negative",
        WITH_SCHED,
        4,
        rf"forge: error: scheduler 'hostile_sched' of {PLUGIN} set the learning rate of parameter group 0 to "
        r"-0\.0003 after step 3; a learning rate must be a finite number >= 0 \(a negative one trains uphill\)\. "
        + SAVED_3,
        setup=schedule("-1.0 if s >= 3 else 1.0"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "scheduler-starts-with-a-negative-rate",
        WITH_SCHED,
        4,
        rf"forge: error: scheduler 'hostile_sched' of {PLUGIN} set the learning rate of parameter group 0 to "
        r"-0\.0003 before the first step; .*Training stopped at step 0; no checkpoint was written yet\.",
        setup=schedule("-1.0"),
        check=nothing_saved,
    ),
    # -- dataset: failing, ending, yielding what the model cannot take ----------------------------------
    Case(
        "dataset-raises-mid-epoch",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} raised while reading batch 4: OSError: shard gone\. "
        + SAVED_3
        + " "
        + without(r"set another \[data\] name"),
        setup=dataset("sample", "if index >= 6: fail(OSError('shard gone'))\n            yield self.sample(index)"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-ends",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} ended after 3 batches; training reads batches until "
        r"\[train\] max_steps, so a dataset must not end \(the built-in ones start another pass over their data\)\. "
        + SAVED_3,
        setup=dataset("sample", "if index >= 6: return\n            yield self.sample(index)"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-raises-a-bare-stop-iteration",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} ended after 3 batches \(a StopIteration raised inside "
        r"its generator\);",
        setup=dataset("sample", "yield self.sample(index) if index < 6 else next(iter(()))"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-yields-none",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} yielded None as a sample \(sample 0 of a batch\); a "
        r"sample is a dict of tensors\. " + SAVED_3,
        setup=dataset("None"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-labels-shorter-than-inputs",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} yielded labels of shape \[15\] per sample beside "
        r"input_ids of shape \[16\] \(batch 4\); they must have the same shape\. " + SAVED_3,
        setup=dataset("{**sample, 'labels': sample['labels'][:-1]}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-int32-ids",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} yielded input_ids of dtype int32 \(batch 4\); token ids "
        r"must be int64 \(torch\.long\)\. " + SAVED_3,
        setup=dataset("{**sample, 'input_ids': sample['input_ids'].int()}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-shorter-than-seq-len",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} yielded input_ids of shape \[12\] per sample \(batch 4\); "
        r"the run's samples are \[16\] \(\[train\] seq_len\)\. " + SAVED_3,
        setup=dataset("{key: value[:12] for key, value in sample.items()}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-longer-than-seq-len",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} yielded input_ids of shape \[32\] per sample \(batch 4\); "
        r"the run's samples are \[16\]",
        setup=dataset("{key: torch.cat([value, value]) for key, value in sample.items()}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-float-document-ids",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} yielded document_ids of dtype float32 \(batch 4\); "
        r"document ids are integers\. " + SAVED_3,
        setup=dataset("{**sample, 'document_ids': sample['document_ids'].float()}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-document-ids-going-down",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} yielded document_ids that go down along a row "
        r"\(batch 4\);",
        setup=dataset("{**sample, 'document_ids': torch.arange(16).flip(0)}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "dataset-document-ids-of-another-shape",
        WITH_DATA,
        4,
        rf"forge: error: dataset 'hostile_data' of {PLUGIN} yielded document_ids of shape \[8\] per sample beside "
        r"input_ids of shape \[16\] \(batch 4\);",
        setup=dataset("{**sample, 'document_ids': torch.arange(8)}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    # -- feed-forward layer and model family: raising, wrong shapes, tuples -------------------------------
    Case(
        "feed-forward-returns-a-wrong-shape",
        WITH_FFN,
        4,
        rf"forge: error: feed-forward layer 'hostile_ffn' of {PLUGIN} returned a tensor of shape \[2, 16, 16\] from "
        r"forward\(\) for an input of shape \[2, 16, 32\]; a feed-forward layer returns a tensor of its input's "
        r"shape \[batch, seq, dim\]\. Training stopped at step 2; the newest checkpoint \(step_2\) is intact\. "
        + without(r"set another \[model\.ffn\] name"),
        setup=feed_forward("out[..., :16]"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "feed-forward-raises-in-forward",
        WITH_FFN,
        4,
        rf"forge: error: feed-forward layer 'hostile_ffn' of {PLUGIN} raised in the forward or backward pass at step "
        rf"3: ValueError: kaput\. {STEP_2_INTACT}",
        setup=feed_forward("fail(ValueError('kaput'))"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "feed-forward-returns-a-tuple",
        WITH_FFN,
        4,
        rf"forge: error: feed-forward layer 'hostile_ffn' of {PLUGIN} returned a tuple from forward\(\)",
        setup=feed_forward("(out, None)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "model-family-raises-in-forward",
        (*TRAIN, "--model.name=hostile_family"),
        4,
        rf"forge: error: model family 'hostile_family' of {PLUGIN} raised in the forward or backward pass at step 3: "
        rf"RuntimeError: kaput\. {STEP_2_INTACT} " + without(r"set another \[model\] name"),
        setup=with_component(FAMILY),
        check=stopped_at(2, [1, 2]),
    ),
    # -- router (forge-moe): indices out of range, wrong forms, non-scalar losses, silent faults ----------
    Case(
        "router-index-out-of-range",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned expert indices outside 0\.\.n_experts-1 "
        rf"\(\d+ forwards\); the step was not taken \(MoE layer \d\)\. {STEP_2_INTACT}",
        setup=router("Routing(r.indices + 4, r.weights, r.aux_losses)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "router-negative-index",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned expert indices outside 0\.\.n_experts-1",
        setup=router("Routing(r.indices - 9, r.weights, r.aux_losses)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "router-returns-none",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned None; a router returns a Routing\(indices, "
        rf"weights, aux_losses\) \(MoE layer \d\)\. {STEP_2_INTACT}",
        setup=router("None"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "router-returns-a-tuple",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned a tuple; a router returns a Routing",
        setup=router("(r.indices, r.weights)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "router-aux-loss-not-a-scalar",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned a tensor of shape \[4\] as an auxiliary loss; "
        r"aux_losses is a dict of names to 0-d floating tensors",
        setup=router("Routing(r.indices, r.weights, {'balance_loss': torch.ones(4)})"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "router-same-expert-twice",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned the same expert more than once for a token",
        setup=router("Routing(r.indices[:, :1].repeat(1, 2), r.weights, r.aux_losses)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "router-fewer-experts-than-top-k",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned indices of shape \[32, 1\] and dtype int64; a "
        r"router returns int64 indices of shape \[tokens, top_k\] = \[32, 2\]",
        setup=router("Routing(r.indices[:, :1], r.weights[:, :1], r.aux_losses)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "router-more-experts-than-top-k",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned indices of shape \[32, 3\]",
        setup=router("Routing(torch.cat([r.indices, r.indices[:, :1]], 1), r.weights, r.aux_losses)"),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "router-negative-weights",
        WITH_ROUTER,
        4,
        rf"forge: error: router 'hostile_router' of {PLUGIN} returned negative combine weights",
        setup=router("Routing(r.indices, -r.weights, r.aux_losses)"),
        check=stopped_at(2, [1, 2]),
    ),
    # -- evaluators ---------------------------------------------------------------------------------------
    Case(
        "evaluator-leaves-gradients",
        WITH_EVAL,
        4,
        rf"forge: error: {PLUGIN} changed the gradients of \d+ parameters \('.*', \.\.\.\) in evaluate\(\) of its "
        r"evaluator 'hostile_eval' at step 3; an evaluator must not run a backward pass through the model",
        setup=evaluator(
            "with torch.enable_grad():\n"
            "            model(torch.zeros(1, 4, dtype=torch.long)).float().sum().backward()\n"
            "        return {}"
        ),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "evaluator-returns-nan",
        WITH_EVAL,
        0,
        r"forge: warning: evaluator 'hostile_eval' \(forge-hostile 1\.0\) returned nan for 'hostile/acc' at step 3; "
        r"logged as it is \(this warning is not repeated\)$",
        setup=evaluator("return {'hostile/acc': math.nan}"),
    ),
    Case(  # issue 34: before, the run died later with a raw AdamW traceback (exit 1), the evaluator not named
        "evaluator-casts-the-weights-to-bf16",
        WITH_EVAL,
        4,
        rf"forge: error: {PLUGIN} changed parameter '.*' from torch\.float32 to torch\.bfloat16 in evaluate\(\) of "
        r"its evaluator 'hostile_eval' at step 3; an evaluator must leave the weights as they are",
        setup=evaluator("model.to(torch.bfloat16)\n        return {}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    Case(
        "evaluator-leaves-the-model-in-train-mode",
        WITH_EVAL,
        4,
        rf"forge: error: {PLUGIN} left \d+ modules \('\(the model\)', \.\.\.\) in train mode in evaluate\(\) of "
        r"its evaluator 'hostile_eval' at step 3; an evaluator must leave the model in the mode it was given",
        setup=evaluator("model.train()\n        return {}"),
        check=stopped_at(3, [1, 2, 3]),
    ),
    # -- model transforms -----------------------------------------------------------------------------------
    Case(  # issue 34: before, the optimizer failed on an "empty parameter list", the transform not named
        "transform-freezes-every-parameter",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} left no parameter to train in apply\(\) of its model transform 'hostile_freeze': "
        r"every parameter of the model has requires_grad = False after it .* run without it \(--block-plugin hostile\)",
        setup=with_component(
            """
from forge_lm.distributed import ModelTransform

def freeze(model, context):
    for param in model.parameters():
        param.requires_grad_(False)

@hookimpl
def forge_lm_register_model_transforms(register):
    register("hostile_freeze", lambda options: ModelTransform("adaptation", lambda c: True, freeze), description="x")
"""
        ),
    ),
    # -- what a plugin must leave alone: the working directory, Ctrl-C ------------------------------------
    Case(
        "step-end-changes-the-working-directory",
        TRAIN,
        4,
        rf"forge: error: {PLUGIN} changed the working directory in forge_lm_step_end from '.*' to '/'; a plugin must "
        r"not \(relative paths of the run would point elsewhere\); it was put back\. Training stopped at step 2 "
        r"after saving",
        setup=lambda ws: install(
            ws, "import os\n\n@hookimpl\ndef forge_lm_step_end(step):\n    if step == 2: os.chdir('/')\n"
        ),
        check=stopped_at(2, [1, 2]),
    ),
    Case(
        "optimizer-changes-the-working-directory",
        WITH_OPT,
        4,
        rf"forge: error: optimizer 'hostile_opt' of {PLUGIN} changed the working directory in step\(\) at step 3 "
        r"from '.*' to '/'; .*Training stopped at step 2 and saved nothing",
        setup=optimizer("os.chdir('/')"),
        check=stopped_at(2, [1, 2]),
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case, plugin_site):
    run_case(case)


def test_a_backend_mutating_the_metrics_changes_nothing_for_the_others(run_case, plugin_site, tmp_path: Path):
    """Each backend gets its own copy of the metrics: one that edits them (adds, removes, rewrites)
    changes what it logs, not what the jsonl backend beside it logs."""
    body = """
class Backend:
    def start(self, config, manifest):
        config.clear()

    def log(self, step, metrics):
        metrics["loss"] = -1.0
        metrics["hostile/added"] = 1.0
        metrics.pop("lr", None)

    def finish(self, summary):
        summary.clear()

@hookimpl
def forge_lm_register_metrics_backends(register):
    register("hostile", lambda options, context: Backend(), description="x")
"""
    case = Case(
        "backend-mutates-the-metrics",
        (*TRAIN, '--metrics.backends=["hostile", "jsonl"]'),
        0,
        r"",
        setup=lambda ws: install(ws, body),
    )
    ws, _ = run_case(case)
    logged = [r for r in records(ws) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and "lr" in r and "hostile/added" not in r for r in logged)
