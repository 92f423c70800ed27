"""An lm-eval ``LM`` backed by a Forge model and its tokenizer.

The semantics are those of lm-eval's Hugging Face backend (``lm_eval.models.huggingface.HFLM``),
so that a Forge checkpoint scores the same here as its ``forge export-hf`` does there:

* ``loglikelihood``: lm-eval's :class:`~lm_eval.api.model.TemplateLM` splits each request into
  context and continuation ids (an empty context becomes the end-of-text id, Forge's only
  document boundary). The window the model reads is the last ``max_length + 1`` ids of context
  plus continuation, less the last one; only the continuation's positions are scored.
  Requests run in batches, right-padded: the model is causal, so padding after a sequence
  changes nothing before it.
* ``loglikelihood_rolling``: lm-eval's own rolling windows (``get_rolling_token_windows`` with
  one token of context, made disjoint), each scored like a loglikelihood request; a text's
  windows are summed.
* ``generate_until``: one request at a time through Forge's KV cache: the context is cut from
  the left to ``max_length - max_gen_toks`` ids, then greedy decoding (or sampling, when the
  task asks for it) runs until the end-of-text id, ``max_gen_toks`` tokens, or a stop sequence;
  the text is cut before the first stop sequence.

Every request runs on every rank that calls it (``rank`` 0 of ``world_size`` 1): in training the
model may be sharded, and each rank must make the same forward calls (see
:class:`forge_lm.components.Evaluator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from forge_lm.api import KVCache, sampling_probs
from forge_lm.errors import ForgeError

# What lm-eval's Hugging Face backend generates at most when a task sets no max_gen_toks.
DEFAULT_MAX_GEN_TOKS = 256
# Generation settings this backend applies; normalize_gen_kwargs fills in the first four.
_SETTINGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}

Request = tuple[Any, list[int], list[int]]  # (cache key or None, context ids, continuation ids)


def generation_settings(gen_kwargs: dict[str, Any], max_length: int, task: str | None) -> dict[str, Any]:
    """A task's generation settings, normalised as lm-eval's backends do (``max_gen_toks`` and
    its aliases, ``do_sample`` and ``temperature``); a ForgeError for settings this backend does
    not apply, and for a ``max_gen_toks`` that leaves no room for a context."""
    settings = dict(normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS))
    unsupported = sorted(set(settings) - _SETTINGS)
    if unsupported:
        raise ForgeError(
            f"lm-eval task '{task}' sets the generation settings {unsupported}, which forge-lm-eval does not apply "
            f"(it applies {', '.join(sorted(_SETTINGS))})"
        )
    if settings["max_gen_toks"] >= max_length:
        raise ForgeError(
            f"lm-eval task '{task}' generates up to {settings['max_gen_toks']} tokens (max_gen_toks), which leaves "
            f"no room for a context in the model's max_seq_len ({max_length}); give the task a smaller max_gen_toks"
        )
    return settings


class ForgeLM(TemplateLM):
    """lm-eval's view of a Forge model: ``model(ids [B, T]) -> logits [B, T, vocab]``.

    ``max_length``: the longest sequence the model reads (its ``max_seq_len``).
    ``batch_size``: sequences per forward pass for loglikelihood requests.
    ``dtype``: autocast dtype (the run's precision), or None for the weights' own.
    ``seed``: of the generator that samples, for tasks with ``do_sample: true``.
    """

    backend = "causal"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        max_length: int,
        batch_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.forge_tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self._device = torch.device(device)
        self.dtype = dtype
        self._sampler = torch.Generator().manual_seed(seed)

    # -- tokens -------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.forge_tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # Forge tokenizers never add special tokens, which is what training saw: a document is
        # its text's ids, after the end-of-text id of the one before.
        ids = self.forge_tokenizer.encode(string)
        left_truncate_len = kwargs.get("left_truncate_len")
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.forge_tokenizer.decode(list(tokens))

    # -- forward ------------------------------------------------------------------------------

    def _logits(self, ids: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        autocast = torch.autocast(self._device.type, dtype=self.dtype, enabled=self.dtype is not None)
        with torch.no_grad(), autocast:
            return self.model(ids, kv_cache=kv_cache) if kv_cache is not None else self.model(ids)

    # -- loglikelihood ------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any):
        """``(log-probability of the continuation, whether greedy decoding gives it)`` per request."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # Longest first: the first batch is the largest, so one that does not fit fails at once.
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            windows = [self._window(requests[i]) for i in chunk]
            batch = torch.full(
                (len(windows), max(map(len, windows))), self.eot_token_id, dtype=torch.long, device=self._device
            )
            for row, window in enumerate(windows):
                batch[row, : len(window)] = torch.tensor(window, dtype=torch.long)
            logits = self._logits(batch)
            for row, i in enumerate(chunk):
                key, _, continuation = requests[i]
                end = len(windows[row])
                # Position p predicts id p + 1: the continuation's ids are predicted by the last
                # len(continuation) positions of the window.
                scored = F.log_softmax(logits[row, end - len(continuation) : end].float(), dim=-1)
                target = torch.tensor(continuation, dtype=torch.long, device=scored.device)
                answer = (
                    float(scored.gather(-1, target[:, None]).sum()),
                    bool((scored.argmax(dim=-1) == target).all()),
                )
                results[i] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _window(self, request: Request) -> list[int]:
        _, context, continuation = request
        if not continuation:
            raise ForgeError(f"a loglikelihood request has an empty continuation: {request[0]!r}")
        if len(continuation) > self.max_length:
            raise ForgeError(
                f"a continuation of {len(continuation)} tokens is longer than the model's max_seq_len "
                f"({self.max_length}); it cannot be scored"
            )
        # Too long for the model: drop ids from the left, as lm-eval's Hugging Face backend does.
        return (context + continuation)[-(self.max_length + 1) :][:-1]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[Request] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            pairs = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, predicted in map(make_disjoint_window, pairs):
                windows.append((None, context, predicted))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ---------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos_text = getattr(self.forge_tokenizer, "eos_token", None)
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args
            settings = generation_settings(gen_kwargs, self.max_length, request.task_name)
            until = handle_stop_sequences(settings["until"], eos=eos_text)
            max_gen_toks = settings["max_gen_toks"]
            room = self.max_length - max_gen_toks
            prompt = self.tok_encode(context)[-room:] or [self.eot_token_id]
            generated = self._generate(prompt, max_gen_toks, until, settings)
            text = self.tok_decode(generated)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            outputs.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return outputs

    def _generate(self, prompt: list[int], max_new: int, until: list[str], settings: dict[str, Any]) -> list[int]:
        """The ids generated after ``prompt`` (the end-of-text id included when it came)."""
        greedy = not settings["do_sample"] or not settings["temperature"]
        cache = KVCache(len(prompt) + max_new)
        tokens: list[int] = []
        logits = self._logits(torch.tensor([prompt], device=self._device), cache)[0, -1]
        while True:
            if greedy:
                next_id = int(torch.argmax(logits))
            else:
                probs = sampling_probs(logits, settings["temperature"], settings.get("top_k"), settings.get("top_p"))
                next_id = int(torch.multinomial(probs.cpu(), 1, generator=self._sampler))
            tokens.append(next_id)
            if next_id == self.eot_token_id or len(tokens) == max_new:
                return tokens
            # A stop sequence may span several tokens, and a token may hold more than one: look
            # at the text generated so far.
            if until:
                text = self.tok_decode(tokens)
                if any(stop and stop in text for stop in until):
                    return tokens
            logits = self._logits(torch.tensor([[next_id]], device=self._device), cache)[0, -1]
