"""The bridge on its own: what it scores and generates, computed independently from the model;
what it refuses; and that it leaves the caller's random generators as they were."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from forge_lm.errors import ForgeError
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.tokenizers.byte_level import ByteTokenizer
from forge_lm.train.inference import load_for_inference
from forge_lm_eval.harness import TaskSet, metrics_of, run_tasks
from forge_lm_eval.lm import ForgeLM

from .conftest import CHOICE, COMPLETE, TASKS

EOS = ByteTokenizer.eos_id
# Scores are sums of tens of nats in fp32: the batched, padded forward and the reference's one
# sequence take other blockings in the matrix products, so their last bits differ (1.5e-5 was
# seen on a sum of -70.7, depending on which tests ran first in the process). Relative 1e-6 is
# eight fp32 ulps; a wrong token or position moves a score by whole units.
SCORE = {"rel": 1e-6}


@pytest.fixture(scope="module")
def loaded(make_run):
    model, _, tokenizer = load_for_inference(make_run("bytes"), PluginManager(PluginSettings(autoload=False)))
    return model, tokenizer


def request(kind: str, *args, task: str = "test") -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=(task, 0, 1))


def logprobs_of(model, ids: list[int]) -> torch.Tensor:
    """Log-probability of each id after the first, from one forward pass over all of them."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0]
    return F.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_a_loglikelihood_is_the_continuations_log_probability_after_its_context(loaded):
    model, tokenizer = loaded
    lm = ForgeLM(model, tokenizer, max_length=64, batch_size=2)
    (score, greedy), (empty_context, _) = lm.loglikelihood(
        [request("loglikelihood", "def f(x):", " return x"), request("loglikelihood", "", "import os")]
    )
    ids = tokenizer.encode("def f(x): return x")
    assert score == pytest.approx(float(logprobs_of(model, ids)[-len(" return x") :].sum()), **SCORE)
    assert isinstance(greedy, bool)
    # An empty context is the end-of-text id, as at the start of every training document.
    assert empty_context == pytest.approx(float(logprobs_of(model, [EOS, *b"import os"]).sum()), **SCORE)


def test_too_long_requests_keep_their_last_max_length_tokens(loaded):
    model, tokenizer = loaded
    lm = ForgeLM(model, tokenizer, max_length=64, batch_size=1)
    context = "# " + "x" * 100
    ((score, _),) = lm.loglikelihood([request("loglikelihood", context, "\npass")])
    window = tokenizer.encode(context + "\npass")[-65:]  # 64 inputs predicting the last 64 ids
    assert score == pytest.approx(float(logprobs_of(model, window)[-5:].sum()), **SCORE)


def test_rolling_loglikelihood_scores_each_token_once(loaded):
    model, tokenizer = loaded
    lm = ForgeLM(model, tokenizer, max_length=64, batch_size=4)
    short, long = "x = 1\n", "".join(f"line {i}\n" for i in range(30))  # 6 and 218 bytes
    scores = lm.loglikelihood_rolling([request("loglikelihood_rolling", short), request("loglikelihood_rolling", long)])
    assert scores[0] == pytest.approx(float(logprobs_of(model, [EOS, *short.encode()]).sum()), **SCORE)
    # Each window of 64 predictions sees the 64 ids before it; the last window is shifted back so
    # that it is full, and scores only the ids not scored yet.
    ids = [EOS, *long.encode()]
    expected = logprobs_of(model, ids[:65]).sum()
    scored = 65
    while scored < len(ids):
        end = min(scored + 64, len(ids))
        expected += logprobs_of(model, ids[end - 65 : end])[-(end - scored) :].sum()
        scored = end
    assert scores[1] == pytest.approx(float(expected), abs=1e-4)


def test_results_do_not_depend_on_the_batch_size(loaded):
    model, tokenizer = loaded
    requests = [request("loglikelihood", f"value_{i} =", " " + "1" * (i + 1)) for i in range(7)]
    one = ForgeLM(model, tokenizer, max_length=64, batch_size=1).loglikelihood(requests)
    seven = ForgeLM(model, tokenizer, max_length=64, batch_size=7).loglikelihood(requests)
    for (a, greedy_a), (b, greedy_b) in zip(one, seven, strict=True):
        assert a == pytest.approx(b, **SCORE)
        assert greedy_a == greedy_b


class Scripted(torch.nn.Module):
    """A model that greedily writes ``script`` (its ids one after the other), whatever it is given."""

    def __init__(self, script: list[int], vocab: int = 257) -> None:
        super().__init__()
        self.script, self.vocab, self.calls = script, vocab, 0
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, kv_cache=None):
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.vocab)
        logits[:, -1, self.script[min(self.calls, len(self.script) - 1)]] = 10.0
        self.calls += 1
        if kv_cache is not None:
            kv_cache.advance(ids.shape[1])
        return logits


def generate(script: bytes | list[int], **gen_kwargs) -> tuple[str, int]:
    """What the bridge returns for a model that writes ``script``, and how many tokens it made."""
    model = Scripted(list(script))
    lm = ForgeLM(model, ByteTokenizer(), max_length=64, batch_size=1)
    (text,) = lm.generate_until([request("generate_until", "prompt", {"do_sample": False, **gen_kwargs})])
    return text, model.calls


def test_generation_stops_at_a_stop_sequence_and_cuts_the_text_before_it():
    assert generate(b"ab\ncd\nef", until=["\n"], max_gen_toks=10) == ("ab", 3)
    assert generate(b"ab\ncd\nef", until=["cd"], max_gen_toks=10) == ("ab\n", 5)  # a stop spanning tokens
    assert generate(b"ab\ncd\nef", until=["d\n", "b"], max_gen_toks=10) == ("a", 2)  # the first one that occurs


def test_generation_stops_at_the_end_of_text_id_and_at_max_gen_toks():
    assert generate([*b"abc", EOS, *b"zzz"], until=[], max_gen_toks=10) == ("abc", 4)
    assert generate(b"abcdefgh", until=["\n"], max_gen_toks=5) == ("abcde", 5)
    assert generate(b"abcdefgh", until=["\n"], max_new_tokens=3) == ("abc", 3)  # lm-eval's alias
    # The end-of-text token's Hugging Face name is a stop sequence too, as in lm-eval's HF backend.
    assert generate(b"ab<|endoftext|>cd", until=[], max_gen_toks=20)[0] == "ab"


def test_generation_decodes_bytes_that_are_not_utf8_as_replacement_characters():
    assert generate([0xE2, 0x82, ord("x"), 0xFF, ord("\n")], until=["\n"], max_gen_toks=10)[0] == "\ufffdx\ufffd"


def test_sampling_is_seeded_and_stays_within_max_gen_toks(loaded):
    model, tokenizer = loaded
    ask = [request("generate_until", "def ", {"do_sample": True, "temperature": 1.0, "max_gen_toks": 8, "until": []})]
    first = ForgeLM(model, tokenizer, max_length=64, batch_size=1, seed=7).generate_until(ask)
    again = ForgeLM(model, tokenizer, max_length=64, batch_size=1, seed=7).generate_until(ask)
    assert first == again
    assert 0 < len(first[0]) <= 8  # a byte is at most one character (or one U+FFFD)


@pytest.mark.parametrize(
    ("gen_kwargs", "message"),
    [
        ({"max_gen_toks": 64}, "lm-eval task 'test' generates up to 64 tokens (max_gen_toks), which leaves no room"),
        ({}, "generates up to 256 tokens"),  # lm-eval's default, as its HF backend uses it
        ({"num_beams": 4}, "lm-eval task 'test' sets the generation settings ['num_beams'], which forge-lm-eval"),
    ],
)
def test_generation_settings_it_cannot_apply_are_refused_naming_the_task(gen_kwargs, message):
    lm = ForgeLM(Scripted(list(b"a")), ByteTokenizer(), max_length=64, batch_size=1)
    with pytest.raises(ForgeError, match=re.escape(message)):
        lm.generate_until([request("generate_until", "x", {"until": ["\n"], **gen_kwargs})])


def test_a_continuation_longer_than_the_model_window_is_refused(loaded):
    model, tokenizer = loaded
    lm = ForgeLM(model, tokenizer, max_length=16, batch_size=1)
    with pytest.raises(ForgeError, match="a continuation of 20 tokens is longer than the model's max_seq_len"):
        lm.loglikelihood([request("loglikelihood", "context", "y" * 20)])


def test_a_generation_task_asking_for_too_many_tokens_is_refused_when_the_tasks_are_loaded(in_tasks_dir):
    with pytest.raises(ForgeError, match="'forge_test_complete' generates up to 12 tokens"):
        TaskSet([COMPLETE], max_length=12)


def test_running_tasks_leaves_pythons_numpys_and_torchs_generators_where_they_were(loaded, in_tasks_dir):
    model, tokenizer = loaded
    tasks = TaskSet([CHOICE], 64)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    run_tasks(ForgeLM(model, tokenizer, max_length=64, batch_size=4), tasks, limit=2)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_autocast_runs_the_forward_passes_in_the_runs_precision(loaded):
    model, tokenizer = loaded
    requests = [request("loglikelihood", "def f(x):", " return x")]
    ((fp32, _),) = ForgeLM(model, tokenizer, max_length=64, batch_size=1).loglikelihood(requests)
    ((bf16, _),) = ForgeLM(model, tokenizer, max_length=64, batch_size=1, dtype=torch.bfloat16).loglikelihood(requests)
    assert bf16 != fp32
    assert bf16 == pytest.approx(fp32, rel=0.05)


def test_tasks_found_beside_the_files_and_in_include_path_need_not_lm_evals_own_index(in_tasks_dir):
    tasks = TaskSet(["forge_test_group", "rolling.yaml"], 64, include_path=[str(TASKS)])
    assert "hellaswag" not in tasks.manager.all_tasks
    assert {"forge_test_group", "forge_test_choice", "forge_test_rolling"} <= set(tasks.manager.all_tasks)


def test_metric_names_drop_the_none_filter_and_keep_the_others():
    results = {
        "results": {
            "gsm8k": {
                "alias": "gsm8k",
                "exact_match,strict-match": 0.25,
                "exact_match_stderr,strict-match": 0.1,
                "exact_match,flexible-extract": 0.5,
            },
            "wikitext": {"word_perplexity,none": 40.0, "word_perplexity_stderr,none": "N/A", "sample_len": 5},
        }
    }
    assert metrics_of(results) == {
        "eval/gsm8k/exact_match/strict-match": 0.25,
        "eval/gsm8k/exact_match_stderr/strict-match": 0.1,
        "eval/gsm8k/exact_match/flexible-extract": 0.5,
        "eval/wikitext/word_perplexity": 40.0,
    }
