"""Sampling with a KV cache: the cache changes no number, and the sampling rules are the documented ones."""

from __future__ import annotations

import math

import pytest
import torch

from forge_lm.errors import ForgeError
from forge_lm.model.generate import generate, sampling_probs
from forge_lm.model.kv_cache import KVCache

from .conftest import VOCAB


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fields", [{"n_kv_heads": 2}, {"qk_norm": True, "n_kv_heads": 1}])
def test_logits_computed_with_the_cache_equal_a_full_forward(make_model, fields):
    model = make_model(**fields)
    seq = tokens(14)
    full = model(torch.tensor([seq]))[0]  # [14, vocab]
    cache = model.new_kv_cache()
    # a 5-token prompt, 4 single tokens, then a 5-token chunk (queries at positions 9..13 see keys 0..i)
    pieces = [seq[:5], *[[t] for t in seq[5:9]], seq[9:]]
    incremental = torch.cat([model(torch.tensor([piece]), kv_cache=cache)[0] for piece in pieces])
    assert cache.length == 14
    assert torch.allclose(incremental, full, atol=1e-5, rtol=0)


def test_the_cache_refuses_tokens_beyond_its_size(make_model):
    model = make_model()
    cache = KVCache(max_len=6)
    model(torch.tensor([tokens(4)]), kv_cache=cache)
    with pytest.raises(ForgeError, match="holds 6 tokens; 4 are cached and 3 more do not fit"):
        model(torch.tensor([tokens(3)]), kv_cache=cache)


def test_cached_positions_count_towards_max_seq_len(make_model):
    model = make_model(max_seq_len=8)
    cache = KVCache(max_len=100)
    model(torch.tensor([tokens(6)]), kv_cache=cache)
    with pytest.raises(ForgeError, match=r"6 cached \+ 3 new tokens exceeds the model's max_seq_len \(8\)"):
        model(torch.tensor([tokens(3)]), kv_cache=cache)


def test_greedy_generation_is_repeated_argmax_over_full_forwards(make_model):
    model = make_model(n_kv_heads=2)
    prompt = tokens(3)
    expected = list(prompt)
    for _ in range(10):
        expected.append(int(model(torch.tensor([expected]))[0, -1].argmax()))
    assert generate(model, prompt, max_new_tokens=10, temperature=0.0) == expected


def test_top_k_one_samples_the_greedy_tokens(make_model):
    model = make_model()
    prompt = tokens(4, seed=1)
    greedy = generate(model, prompt, 8, temperature=0.0)
    assert generate(model, prompt, 8, temperature=1.5, top_k=1, generator=torch.Generator().manual_seed(3)) == greedy


def test_sampling_is_reproducible_with_a_seeded_generator(make_model):
    model = make_model()
    prompt = tokens(2)

    def sample(seed: int) -> list[int]:
        return generate(model, prompt, 12, temperature=2.0, generator=torch.Generator().manual_seed(seed))

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_generation_stops_after_eos_and_returns_it(make_model):
    prompt = tokens(3)
    # A tiny random model's greedy output often repeats one token: take the first seed whose
    # output brings a new token at step 2 or later, to play the end-of-sequence token.
    for seed in range(20):
        model = make_model(seed)
        greedy = generate(model, prompt, 12, temperature=0.0)[3:]
        new_tokens = [t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i]]  # first appears at step i
        if new_tokens:
            break
    eos = new_tokens[0]
    stop = greedy.index(eos)
    assert generate(model, prompt, 12, temperature=0.0, eos_id=eos) == prompt + greedy[: stop + 1]


def test_generate_restores_training_mode_and_returns_the_prompt_for_zero_new_tokens(make_model):
    model = make_model().train()
    assert generate(model, [1, 2], max_new_tokens=0) == [1, 2]
    generate(model, [1, 2], max_new_tokens=2)
    assert model.training


def test_top_k_keeps_the_k_largest_after_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    probs = sampling_probs(logits, temperature=0.5, top_k=2)  # scaled logits 4, 2, ...; keep 2
    first = 1 / (1 + math.exp(-2))
    assert torch.allclose(probs, torch.tensor([first, 1 - first, 0, 0, 0]), atol=1e-6)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.3, [1.0, 0, 0, 0]),  # the most likely token alone already reaches 0.3
        (0.75, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75
        (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_keeps_the_smallest_most_likely_set_reaching_p(top_p, expected):
    logits = torch.tensor([0.3, 0.05, 0.5, 0.15]).log()  # shuffled: the order of tokens must not matter
    order = [2, 0, 3, 1]  # token ids from most to least likely
    probs = sampling_probs(logits, top_p=top_p)
    assert torch.allclose(probs[order], torch.tensor(expected), atol=1e-6)


def test_top_k_then_top_p_renormalises_in_between():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # top-k 3: 0.5/0.95 = 0.526, 0.316, 0.158; top-p 0.6: 0.526 < 0.6 so the second stays, the third goes
    probs = sampling_probs(logits, top_k=3, top_p=0.6)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"top_k": 0}, "top_k must be >= 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"max_new_tokens": 60}, r"prompt \(5 tokens\) plus max_new_tokens \(60\) exceeds the model's max_seq_len"),
    ],
)
def test_invalid_sampling_settings_are_refused_with_the_rule(make_model, kwargs, message):
    arguments = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ForgeError, match=message):
        generate(make_model(), tokens(5), **arguments)


def test_a_temperature_near_zero_samples_the_most_likely_token_instead_of_overflowing():
    logits = torch.tensor([2.0, 5.0, -1.0, 4.5])
    probs = sampling_probs(logits, temperature=1e-45)  # raw logits / 1e-45 overflow to inf (nan probs)
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(sampling_probs(logits, temperature=0.7), torch.softmax(logits / 0.7, dim=-1), atol=1e-7)


def test_an_empty_prompt_or_unknown_token_is_refused(make_model):
    model = make_model()
    with pytest.raises(ForgeError, match="prompt is empty"):
        generate(model, [], 3)
    with pytest.raises(ForgeError, match=r"outside the model's vocabulary \[0, 61\)"):
        generate(model, [VOCAB], 3)
