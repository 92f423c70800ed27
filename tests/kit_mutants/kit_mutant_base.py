"""The good components of the mutant corpus, one per category, and the in-process plugin that
registers a component under test.

Each mutant in ``mutants/`` is one of these with one realistic bug planted: the kit must fail
the mutant on the check its module names, and pass every check on the good version.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from forge_lm import hookimpl
from forge_lm.components import IGNORE_INDEX
from forge_lm.distributed import ModelTransform
from forge_lm.plugins import CATEGORIES, PluginManager, PluginSettings

NAME = "mutant"  # every component under test is registered under this name


def manager_with(category: str, factory: Any, options: type | None = None) -> PluginManager:
    """A fresh manager (built-ins only) with ``factory`` registered as ``category`` '{NAME}'."""
    manager = PluginManager(PluginSettings(autoload=False))

    class CorpusPlugin:
        FORGE_LM_PLUGIN_API = ">=1,<2"

    def hook(wanted: str) -> Any:
        def register_category(self: Any, register: Any) -> None:
            if wanted == category:
                register(NAME, factory, config=options, description="kit mutant corpus")

        register_category.__name__ = f"forge_lm_register_{wanted}"
        return hookimpl(register_category)

    for each in CATEGORIES:
        setattr(CorpusPlugin, f"forge_lm_register_{each}", hook(each))
    info = manager.add_plugin(CorpusPlugin(), "kit-corpus", distribution="forge-kit-corpus", version="1.0")
    assert info.status == "ok", info.reason
    return manager


# ---------------------------------------------------------------- feed-forward layers
class GeluMLP(nn.Module):
    """A GELU MLP; its linear layers get the model's default initialisation rule."""

    def __init__(self, dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def gelu_mlp(options: Any, dim: int, layer_index: int) -> nn.Module:
    return GeluMLP(dim)


# ---------------------------------------------------------------- attention layers
def gqa(options: Any, spec: Any, layer_index: int) -> nn.Module:
    from forge_lm.model.attention import build_gqa

    return build_gqa(options, spec, layer_index)


# ---------------------------------------------------------------- model families
def llama(options: Any, context: Any) -> nn.Module:
    from forge_lm.model.transformer import build_llama

    return build_llama(options, context)


def llama_options() -> type:
    from forge_lm.config import LlamaOptions

    return LlamaOptions


TINY_MODEL = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32}


# ---------------------------------------------------------------- model transforms
@attrs.define
class FreezeOptions:
    enabled: bool = True
    prefix: str = "embed"  # parameters whose names start with it are frozen


def freeze_embeddings(options: FreezeOptions) -> ModelTransform:
    def apply(model: nn.Module, context: Any) -> None:
        for name, param in model.named_parameters():
            if name.startswith(options.prefix):
                param.requires_grad_(False)

    return ModelTransform("adaptation", lambda context: options.enabled, apply)


# ---------------------------------------------------------------- evaluators
class NextTokenAccuracy:
    """The share of next tokens the model predicts on a fixed text."""

    TEXT = "the quick brown fox jumps over the lazy dog"

    def __init__(self, context: Any) -> None:
        self.ids = torch.tensor([context.tokenizer.encode(self.TEXT)[: context.max_seq_len]])

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        logits = model(self.ids[:, :-1])
        right = (logits.argmax(-1) == self.ids[:, 1:]).float().mean()
        return {"eval/next_token/accuracy": float(right)}


def next_token_accuracy(options: Any, context: Any) -> NextTokenAccuracy:
    return NextTokenAccuracy(context)


# ---------------------------------------------------------------- tokenizers
class Utf8Tokenizer:
    """UTF-8 bytes; the end-of-text id past them, decoded to nothing."""

    vocab_size, eos_id = 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def utf8_tokenizer(options: Any) -> Utf8Tokenizer:
    return Utf8Tokenizer()


# ---------------------------------------------------------------- schedulers
@attrs.define
class InverseSqrtOptions:
    warmup: int = 0  # not called warmup_steps: the kit finds it all the same


def inverse_sqrt_factor(step: int, warmup: int) -> float:
    return (step + 1) / warmup if step < warmup else math.sqrt(warmup / (step + 1))


def lambda_schedule(options: InverseSqrtOptions, optimizer: Any, factor: Any) -> Any:
    """``factor(step, warmup)`` times the base rate at each step."""
    warmup = max(1, options.warmup)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(step, warmup))


def inverse_sqrt(options: InverseSqrtOptions, optimizer: Any, total_steps: int) -> Any:
    return lambda_schedule(options, optimizer, inverse_sqrt_factor)


# ---------------------------------------------------------------- optimizers
@attrs.define
class MomentumOptions:
    lr: float = 0.1


def momentum_sgd(options: MomentumOptions, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=options.lr, momentum=0.9)


# ---------------------------------------------------------------- losses
def cross_entropy(options: Any) -> Any:
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)

    return loss


def cross_entropy_by_hand(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The independent reference: log-softmax and a mean over the counted positions."""
    kept = labels != IGNORE_INDEX
    logp = logits.double().log_softmax(-1)[kept]
    return -logp.gather(-1, labels[kept][:, None]).mean()


# ---------------------------------------------------------------- datasets
class CountingTokens:
    """Deterministic windows of a seeded stream; rank ``r`` of ``n`` takes every n-th window."""

    def __init__(self, context: Any) -> None:
        self.context, self.index = context, 0

    def _sample(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.context.seed * 100_003 + index)
        ids = torch.randint(0, self.context.vocab_size, (self.context.seq_len + 1,), generator=generator)
        return {"input_ids": ids[:-1], "labels": ids[1:]}

    def __iter__(self) -> Any:
        while True:
            window = self.index * self.context.dp_size + self.context.dp_rank
            self.index += 1
            yield self._sample(window)

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = int(state["index"])


def counting_tokens(options: Any, context: Any) -> CountingTokens:
    return CountingTokens(context)


# ---------------------------------------------------------------- metrics backends
class JsonLinesBackend:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "corpus-metrics.jsonl"
        self.records: list[str] = []

    def start(self, config: Any, manifest: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: Any) -> None:
        shown = {key: (None if math.isnan(value) else value) for key, value in metrics.items()}
        self.records.append(json.dumps({"step": step, **shown}))

    def finish(self, summary: Any) -> None:
        self.path.write_text("".join(line + "\n" for line in self.records))


def json_lines_backend(options: Any, context: Any) -> JsonLinesBackend:
    return JsonLinesBackend(context.run_dir)


def read_json_lines(run_dir: Path, output: str) -> list[tuple[int, dict[str, float]]]:
    records = []
    for line in (Path(run_dir) / "corpus-metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        records.append((step, {k: float("nan") if v is None else v for k, v in record.items()}))
    return records


# ---------------------------------------------------------------- routers
class SoftmaxTopK(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate, self.top_k = nn.Linear(dim, n_experts, bias=False), top_k

    def forward(self, x: torch.Tensor) -> Any:
        probs = self.gate(x.flatten(0, 1)).float().softmax(-1)
        weights, indices = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        balance = probs.mean(0).square().sum() * probs.shape[-1] * 0.01
        return SimpleNamespace(indices=indices, weights=weights, aux_losses={"balance": balance})


def softmax_top_k(options: Any, dim: int, n_experts: int, top_k: int) -> SoftmaxTopK:
    return SoftmaxTopK(dim, n_experts, top_k)


GOOD: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "feed_forwards": (gelu_mlp, None, {}),
    "attentions": (gqa, None, {}),
    "models": (llama, llama_options, {"options": TINY_MODEL}),
    "model_transforms": (freeze_embeddings, FreezeOptions, {}),
    "evaluators": (next_token_accuracy, None, {}),
    "tokenizers": (utf8_tokenizer, None, {}),
    "schedulers": (inverse_sqrt, InverseSqrtOptions, {}),
    "optimizers": (momentum_sgd, MomentumOptions, {"options": {"lr": 0.1}}),
    "losses": (cross_entropy, None, {"reference": cross_entropy_by_hand}),
    "datasets": (counting_tokens, None, {}),
    "metrics_backends": (json_lines_backend, None, {"read_back": read_json_lines}),
    "routers": (softmax_top_k, None, {}),
}
"""Per category: (factory, options class or a function returning it, kit aids)."""


def options_class(options: Any) -> type | None:
    return options() if callable(options) and not attrs.has(options) else options
