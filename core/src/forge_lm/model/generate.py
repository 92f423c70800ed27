"""Sampling from a model with a KV cache: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from forge_lm.components import DecodesWithCache, GenerationLimits
from forge_lm.errors import ForgeError


def sampling_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The distribution the next token is drawn from, fp32, from ``logits`` ``[vocab]``.

    In this order (that of Hugging Face): divide by ``temperature`` (> 0); keep the ``top_k``
    largest logits (ties with the k-th are kept too); renormalise; keep the smallest set of most
    likely tokens whose probability mass reaches ``top_p`` (a token stays iff the mass of the
    tokens more likely than it is below ``top_p``, so the most likely one always stays);
    renormalise.
    """
    logits = logits.float()
    # Shifted so the largest is 0 before dividing (softmax does not change): a temperature near 0
    # then sends the others towards -inf, where dividing the raw logits would overflow to inf.
    logits = (logits - logits.max()) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # exclusive prefix sums
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order] = mass_before < top_p
        keep[order[0]] = True  # rounding must never empty the set
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def generate(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> list[int]:
    """``prompt`` followed by up to ``max_new_tokens`` sampled tokens (the prompt is included).

    ``temperature = 0`` is greedy (argmax). Generation stops after ``eos_id`` is produced (it is
    the last returned token). The prompt is run once, then one token per step against the KV cache
    of the model's ``new_kv_cache`` (:class:`~forge_lm.components.DecodesWithCache`); a model
    without one runs the whole sequence again for each token (the same tokens, more slowly).
    ``generator`` (on the CPU or the model's device) makes sampling reproducible. The model is put
    in eval mode while sampling and restored afterwards.

    ``inputs``: more keyword arguments of the model's forward that belong to the prompt (a
    vision-language model's ``pixel_values``), moved to the model's device. With a KV cache they
    go with the prompt's forward only (the cache holds what they gave); without one, with every
    full forward (the prompt is in each).
    """
    prompt = [int(t) for t in prompt]
    _check_arguments(model, prompt, max_new_tokens, temperature, top_k, top_p)
    device = next(model.parameters()).device
    sample_device = generator.device if generator is not None else device
    tokens = list(prompt)
    extra = {name: value.to(device) for name, value in (inputs or {}).items()}
    if max_new_tokens == 0:
        return tokens
    cached = isinstance(model, DecodesWithCache)
    cache = model.new_kv_cache(len(prompt) + max_new_tokens) if cached else None

    def next_logits(new: list[int], prefill: bool = False) -> torch.Tensor:
        if cache is None:  # no cache: the whole sequence so far, the prompt's inputs with it
            return model(torch.tensor([tokens], device=device), **extra)[0, -1]
        with_prompt = extra if prefill else {}  # later steps read the cache
        return model(torch.tensor([new], device=device), kv_cache=cache, **with_prompt)[0, -1]  # [vocab]

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            logits = next_logits(prompt, prefill=True)
            for step in range(max_new_tokens):
                if temperature == 0:
                    next_id = int(torch.argmax(logits))
                else:
                    probs = sampling_probs(logits, temperature, top_k, top_p).to(sample_device)
                    next_id = int(torch.multinomial(probs, 1, generator=generator))
                tokens.append(next_id)
                if next_id == eos_id or step == max_new_tokens - 1:
                    break
                logits = next_logits([next_id])
    finally:
        model.train(was_training)
    return tokens


def _check_arguments(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> None:
    if not prompt:
        raise ForgeError("the prompt is empty; give at least one token (for example the tokenizer's eos_id).")
    if max_new_tokens < 0:
        raise ForgeError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ForgeError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ForgeError(f"top_k must be >= 1 (or unset), got {top_k}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ForgeError(f"top_p must be in (0, 1] (or unset), got {top_p}.")
    if not isinstance(model, GenerationLimits):  # a family that declares no limits: its own errors stand
        return
    vocab, limit = model.vocab_size, model.max_seq_len
    if not all(0 <= t < vocab for t in prompt):
        raise ForgeError(f"the prompt has token ids outside the model's vocabulary [0, {vocab}).")
    if len(prompt) + max_new_tokens > limit:
        raise ForgeError(
            f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_seq_len ({limit}); lower max_new_tokens or shorten the prompt."
        )
