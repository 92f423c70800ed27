"""Multi-token prediction: the loss against DeepSeek-V3's formulation written out per document
with truncated sequences, its place among the losses, and its cost outside training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forge_lm.config import structure_config
from forge_lm.losses.aux import collect_aux
from forge_lm.model import build_model

VOCAB = 53
WEIGHT = 0.7


def tiny_model(manager, **model) -> torch.nn.Module:
    table = {
        "name": "deepseek_v3",
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "max_seq_len": 32,
        "init_std": 0.2,
        "n_dense_layers": 1,
        "mtp_depth": 2,
        "mtp_loss_weight": WEIGHT,
        "attention": {"name": "mla", "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4},
        "ffn": {"name": "moe", "n_experts": 4, "top_k": 2, "n_shared_experts": 1, "router": {"name": "sigmoid_topk"}},
        **model,
    }
    config = structure_config({"model": table, "train": {"seq_len": 32}}, manager.registry)
    torch.manual_seed(0)
    return build_model(config.model, VOCAB, manager.registry).train()


def reference_mtp_loss(model, input_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP loss, each document run alone: depth ``k`` sees the sequence truncated to
    ``L - k`` positions, combines the previous depth's hidden state at ``i`` with the embedding of
    token ``i + k``, and is scored on the tokens ``i + k + 1`` that exist in the document; the
    loss is ``weight * mean_k`` of each depth's mean over all its scored positions."""
    per_depth = {k: [] for k in range(1, len(model.mtp) + 1)}
    for row, documents in zip(input_ids, document_ids, strict=True):
        for document in documents.unique():
            tokens = row[documents == document][None]  # [1, L]
            length = tokens.shape[1]
            cos, sin = model.rope(0, length)
            hidden = model.tok_embeddings(tokens)
            for block in model.layers:
                hidden = block(hidden, cos, sin, None, True, None)
            for k, module in enumerate(model.mtp, start=1):
                if length - k < 1:
                    break
                keep = length - k
                x = module.eh_proj(
                    torch.cat((module.enorm(model.tok_embeddings(tokens[:, k:])), module.hnorm(hidden[:, :keep])), -1)
                )
                hidden = module.block(x, cos[:keep], sin[:keep], None, True, None)
                logits = model.output(module.norm(hidden))[0]  # [L - k, vocab]
                for i in range(keep - 1):  # position i predicts token i + k + 1 of the document
                    per_depth[k].append(F.cross_entropy(logits[i], tokens[0, i + k + 1]))
    means = [torch.stack(losses).mean() for losses in per_depth.values()]
    return WEIGHT * torch.stack(means).mean()


def test_mtp_loss_matches_deepseeks_formulation_per_document(deepseek_manager):
    model = tiny_model(deepseek_manager)
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (2, 20), generator=generator)
    # Documents of 9, 1, 2 and 8 tokens, and one of 20: documents of one or two tokens have no
    # target at any depth (depth 1 predicts two tokens ahead).
    document_ids = torch.tensor([[0] * 9 + [1] + [2] * 2 + [3] * 8, [5] * 20])
    with collect_aux() as collector:
        model(input_ids, document_ids)
    expected = reference_mtp_loss(model, input_ids, document_ids)
    assert expected > 1.0
    torch.testing.assert_close(collector.losses["mtp_loss"], expected, rtol=1e-5, atol=1e-6)
    assert set(collector.metrics) >= {"mtp/depth1_loss", "mtp/depth2_loss"}


def test_mtp_loss_reaches_every_mtp_parameter_and_leaves_the_logits_alone(deepseek_manager):
    model = tiny_model(deepseek_manager)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(input_ids)  # no collector: the trunk alone
    with collect_aux() as collector:
        logits = model(input_ids)
    assert torch.equal(logits, plain)  # what the training loss is computed from
    collector.losses["mtp_loss"].backward()
    for name, parameter in model.mtp.named_parameters():
        assert parameter.grad is not None, name
    assert model.tok_embeddings.weight.grad.abs().sum() > 0  # the shared embedding learns from MTP too


def test_outside_a_training_step_the_mtp_modules_do_not_run(deepseek_manager):
    model = tiny_model(deepseek_manager)
    calls = []
    model.mtp[0].register_forward_hook(lambda *_: calls.append(1))
    input_ids = torch.randint(0, VOCAB, (1, 8))
    model(input_ids)  # training mode, but no collector: nothing would receive the loss
    with collect_aux():
        model.eval()(input_ids)  # a collector, but evaluation
    with torch.no_grad():
        cache = model.new_kv_cache(16)
        model(input_ids, kv_cache=cache)  # decoding
    assert calls == []
    with collect_aux():
        model.train()(input_ids)
    assert calls == [1]


def test_flops_per_token_counts_the_mtp_modules_a_training_step_runs(deepseek_manager):
    """A training step's forward and backward, MTP included, counted against ``flops_per_token``:
    exact but for the 6 FLOPs per vector parameter that the declared number counts and no matrix
    product performs (the conformance kit allows 1% either way; this holds the count tighter)."""
    from torch.utils.flop_counter import FlopCounterMode

    from forge_lm.model.linear import kernel

    ffn = {"name": "moe", "n_experts": 4, "top_k": 2, "n_shared_experts": 1, "expert_kernel": "loop"}
    model = tiny_model(deepseek_manager, attention_backend="eager", ffn={**ffn, "router": {"name": "sigmoid_topk"}})
    seq = 32
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    with kernel("aten"), FlopCounterMode(display=False) as counter, collect_aux() as collector:
        (model(ids).square().mean() + collector.losses["mtp_loss"]).backward()
    counted = counter.get_total_flops() / seq
    vectors = sum(p.numel() for p in model.parameters() if p.ndim < 2)
    declared = model.flops_per_token(seq)
    assert counted < declared <= counted + 6 * vectors
    assert declared - 6 * vectors == pytest.approx(counted, rel=1e-3)
