"""With a z-loss, the logged ``loss`` and ``eval/loss`` are the cross-entropy; the gradient is the total's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from forge_lm.data.loader import BatchLoader
from forge_lm.model import build_model
from forge_lm.train.builders import build_dataset
from forge_lm.train.evaluate import Evaluator
from forge_lm.train.step import compute_gradients, loss_function

Z_WEIGHT = 0.05
VOCAB = 257


def _fresh(config, manager):
    torch.manual_seed(0)
    model = build_model(config.model, VOCAB, manager.registry)
    batches = iter(BatchLoader(build_dataset(config, manager.registry, None, VOCAB, "train"), 4))
    return model, batches


@pytest.mark.parametrize("loss_name", ["cross_entropy", "chunked_cross_entropy"])
def test_logged_loss_is_the_cross_entropy_and_the_gradient_includes_the_z_loss(
    tiny_config, manager, one_process_parts, loss_name
):
    config = tiny_config(f"--loss.name={loss_name}", f"--loss.z_loss_weight={Z_WEIGHT}", "--train.grad_clip=0")
    model, batches = _fresh(config, manager)
    loss, _, reports = compute_gradients(one_process_parts(model, config), batches, config)
    loss, aux = loss.item(), reports.logged()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}

    reference, ref_batches = _fresh(config, manager)
    batch = next(ref_batches)
    logits = reference(batch["input_ids"], batch.get("document_ids")).flatten(0, 1)
    labels = batch["labels"].flatten()
    ce = F.cross_entropy(logits, labels)
    counted = labels != -100
    z = torch.logsumexp(logits, dim=-1)[counted].square().mean()  # the z-loss written out by hand
    (ce + Z_WEIGHT * z).backward()

    assert loss == pytest.approx(ce.item(), rel=1e-6)  # not ce + 0.05 z
    assert abs(loss - (ce + Z_WEIGHT * z).item()) > 1e-3  # the two differ enough for the check to mean something
    assert aux["z_loss"] == pytest.approx(Z_WEIGHT * z.item(), rel=1e-5)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_eval_loss_and_perplexity_are_those_of_the_cross_entropy(tiny_config, manager):
    config = tiny_config(f"--loss.z_loss_weight={Z_WEIGHT}")
    torch.manual_seed(0)
    model = build_model(config.model, VOCAB, manager.registry).eval()
    data = build_dataset(config, manager.registry, None, VOCAB, "eval")
    evaluator = Evaluator(data, 4, 2, torch.device("cpu"), None, VOCAB)
    results = evaluator.run(loss_function(model, config.loss.build()), lambda value: value)

    with torch.no_grad():
        want = []
        reference_batches = iter(BatchLoader(build_dataset(config, manager.registry, None, VOCAB, "eval"), 4))
        for batch in (next(reference_batches) for _ in range(2)):  # the data is endless: take two
            logits = model(batch["input_ids"], batch.get("document_ids"))
            want.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item())
    assert results["eval/loss"] == pytest.approx(sum(want) / 2, rel=1e-6)
    assert results["eval/perplexity"] == pytest.approx(math.exp(sum(want) / 2), rel=1e-6)


def test_a_run_logs_the_z_loss_apart_from_the_loss(tiny_config, manager):
    from forge_lm.metrics.jsonl import read_metrics
    from forge_lm.train import train

    config = tiny_config(f"--loss.z_loss_weight={Z_WEIGHT}", "--train.max_steps=3")
    records = read_metrics(train(config, manager).run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert steps
    assert all(r["z_loss"] > 0 for r in steps)
    assert all("eval/perplexity" in r for r in records if "eval/loss" in r)
