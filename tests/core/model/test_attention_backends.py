"""Packed documents through FlexAttention's block mask and eager attention against SDPA's dense
mask, and which one each device gets (``[model] attention_backend``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask

from forge_lm.config import load_config
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.model import attention
from forge_lm.model.attention import (
    ATTENTION_BACKENDS,
    EAGER_MAX_KEYS,
    Attention,
    attention_mask,
    document_block_mask,
    uses_eager,
    uses_flex,
)
from forge_lm.model.kv_cache import KVCache

from .conftest import VOCAB
from .test_transformer import reference_logits

# Eager FlexAttention (CPU) warns once that it is unfused; that is the point of these tests.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

EPS = torch.finfo(torch.float32).eps
SEQ = 150  # more than one 128-token tile, and not a multiple of it: full, partial and padded tiles
CPU = torch.device("cpu")


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int) -> None:
    """``|actual - expected| <= ulps`` float32 ulps of the largest ``|expected|``."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=ulps * EPS * expected.abs().max().item())


def packed_documents() -> torch.Tensor:
    """``[3, SEQ]``: documents of 40 tokens (boundaries inside and across tiles); a boundary in
    the second tile only; one document (its row needs no mask, the batch still does)."""
    positions = torch.arange(SEQ)
    return torch.stack([positions // 40, (positions >= 130).long(), torch.full((SEQ,), 5)])


@pytest.fixture
def flex_backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch refuses FlexAttention's backward on CPU (its fused backward is for CUDA), and so does
    Forge (:func:`attention.check_flex_backward`); torch's eager backward itself runs on CPU. Lift
    both refusals so that the flex path's gradients can be compared with SDPA's here."""
    validate = flex_module._validate_device
    monkeypatch.setattr(flex_module, "_validate_device", lambda q, k, v: validate(q.detach(), k.detach(), v.detach()))
    monkeypatch.setattr(attention, "check_flex_backward", lambda query: None)


@pytest.fixture
def fresh_compiled_cache():
    """The compiled functions are cached per process; a test that fakes torch.compile starts and
    ends with an empty cache, so neither it nor later tests see another test's wrappers."""
    attention._compiled.cache_clear()
    yield
    attention._compiled.cache_clear()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in model.named_parameters()}


ARCHITECTURES = {
    "mha": {},
    "gqa-2-kv-heads": {"n_kv_heads": 2},
    "mqa-qk-norm": {"n_kv_heads": 1, "qk_norm": True},
}


@pytest.mark.usefixtures("flex_backward_on_cpu")
@pytest.mark.parametrize("fields", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
def test_flex_logits_and_gradients_equal_the_sdpa_mask(make_model, fields):
    """Tolerance: 8 float32 ulps of the largest logit, 16 of each parameter's largest gradient
    (measured: at most 5 and 9; a wrong mask or head mapping moves them by whole units)."""
    documents = packed_documents()
    assert isinstance(attention_mask(documents, 0, SEQ, CPU, "flex")[0], BlockMask)
    logits, sdpa, ids = train_step_against_sdpa(make_model, "flex", fields, documents)
    # The mask did cut attention: the packed rows differ from the same tokens without documents.
    assert not torch.allclose(logits[0], sdpa(ids)[0], atol=1e-3)


def train_step_against_sdpa(make_model, backend: str, fields: dict, documents: torch.Tensor | None) -> tuple:
    """One forward and backward of the same model and batch through ``backend`` and through SDPA:
    logits within 8 float32 ulps of the largest, each parameter's gradient within 16 of its
    largest. Returns ``(backend's logits, the SDPA model, the input ids)``."""
    sdpa = make_model(attention_backend="sdpa", max_seq_len=SEQ, **fields).train()
    other = make_model(attention_backend=backend, max_seq_len=SEQ, **fields).train()
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(6))
    logits = {}
    for name, model in (("sdpa", sdpa), (backend, other)):
        logits[name] = model(ids, documents)
        F.cross_entropy(logits[name].flatten(0, 1), labels.flatten()).backward()
    assert_within_ulps(logits[backend], logits["sdpa"], 8)
    expected = grads(sdpa)
    for name, grad in grads(other).items():
        assert_within_ulps(grad, expected[name], 16)
    return logits[backend], sdpa, ids


@pytest.mark.parametrize("backend", ["flex", "eager"])
def test_the_document_mask_matches_the_written_out_reference(make_model, backend):
    """Independent of SDPA: the float64 per-token reference of test_transformer."""
    model = make_model(attention_backend=backend, n_kv_heads=2)
    documents = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids, torch.tensor([documents]))
    assert torch.allclose(logits[0].double(), reference_logits(model, ids[0].tolist(), documents), atol=2e-5, rtol=0)


@pytest.mark.usefixtures("flex_backward_on_cpu")
def test_a_one_document_block_mask_is_causal_attention():
    """One document per row: the block mask gives SDPA's causal attention, outputs and input
    gradients (GQA, 4 query heads on 2 key/value heads), within 8 ulps."""
    torch.manual_seed(0)
    layer = Attention(dim=32, n_heads=4, n_kv_heads=2, layer_index=0)
    x = torch.randn(2, SEQ, 32, requires_grad=True)
    cos, sin = torch.randn(SEQ, 8), torch.randn(SEQ, 8)
    block_mask = document_block_mask(torch.tensor([[3] * SEQ, [7] * SEQ]))
    out_flex = layer(x, cos, sin, block_mask, False)
    (grad_flex,) = torch.autograd.grad(out_flex.square().sum(), x)
    out_sdpa = layer(x, cos, sin, None, True)
    (grad_sdpa,) = torch.autograd.grad(out_sdpa.square().sum(), x)
    assert_within_ulps(out_flex, out_sdpa, 8)
    assert_within_ulps(grad_flex, grad_sdpa, 8)
    # A model never builds it: batches of one document per row take SDPA's causal kernel on any backend.
    assert attention_mask(torch.tensor([[3] * SEQ, [7] * SEQ]), 0, SEQ, CPU, "flex") == (None, True)


def counting(calls: list[str], name: str, function):
    def count(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    return count


@pytest.mark.parametrize(("backend", "block_masks", "flex_calls"), [("flex", 1, 4), ("sdpa", 0, 0)])
def test_the_block_mask_is_built_once_per_forward_and_shared_by_every_layer(
    make_model, monkeypatch, backend, block_masks, flex_calls
):
    calls: list[str] = []
    monkeypatch.setattr(attention, "create_block_mask", counting(calls, "mask", attention.create_block_mask))
    monkeypatch.setattr(attention, "flex_attention", counting(calls, "flex", attention.flex_attention))
    model = make_model(attention_backend=backend, n_layers=4, max_seq_len=SEQ)
    ids = torch.zeros(3, SEQ, dtype=torch.long)
    with torch.no_grad():
        for forward in (1, 2):
            model(ids, packed_documents())
            assert calls.count("mask") == forward * block_masks
            assert calls.count("flex") == forward * flex_calls


@pytest.mark.usefixtures("fresh_compiled_cache")
def test_on_cuda_auto_selects_the_compiled_flex_functions_once(make_model, monkeypatch):
    """With the device check saying CUDA, ``auto`` compiles ``create_block_mask`` and
    ``flex_attention`` once per process and calls the compiled wrappers (here stand-ins that run
    the eager functions, so the logits can still be compared with SDPA's on CPU)."""
    compiled: list[object] = []
    calls: list[str] = []
    real_compile = torch.compile

    def fake_compile(function, **options):
        if options:  # eager flex_attention itself runs through torch.compile(..., backend=<eager>)
            return real_compile(function, **options)
        compiled.append(function)
        return counting(calls, function.__name__, function)

    monkeypatch.setattr(attention, "is_cuda", lambda device: True)
    monkeypatch.setattr(torch, "compile", fake_compile)
    model = make_model(attention_backend="auto", max_seq_len=SEQ)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        for _ in range(2):
            logits = model(ids, packed_documents())
        expected = make_model(attention_backend="sdpa", max_seq_len=SEQ)(ids, packed_documents())
    assert compiled == [flex_module.create_block_mask, flex_module.flex_attention]
    assert calls.count("create_block_mask") == 2
    assert calls.count("flex_attention") == 2 * model.config.n_layers
    assert attention.flex_function(CPU) is not flex_module.flex_attention  # the compiled one
    assert_within_ulps(logits, expected, 8)


@pytest.mark.parametrize(
    ("backend", "cuda", "expected"),
    [("auto", True, True), ("auto", False, False), ("sdpa", True, False), ("flex", False, True)],
)
def test_auto_means_flex_on_cuda_and_sdpa_elsewhere(monkeypatch, backend, cuda, expected):
    monkeypatch.setattr(attention, "is_cuda", lambda device: cuda)
    assert uses_flex(backend, CPU) is expected


def test_on_cpu_the_eager_flex_function_is_used():
    assert attention.flex_function(CPU) is flex_module.flex_attention


def test_training_through_flex_on_cpu_is_refused_with_the_fix(make_model):
    model = make_model(attention_backend="flex", max_seq_len=SEQ).train()
    ids = torch.zeros(3, SEQ, dtype=torch.long)
    with pytest.raises(ForgeError, match=r"attention_backend = 'flex' cannot train on cpu.*Use 'auto' or 'sdpa'"):
        model(ids, packed_documents())
    with torch.no_grad():
        model(ids, packed_documents())  # evaluation works


def test_an_unknown_backend_is_refused_naming_the_choices(manager):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--model.attention_backend=flash"], manager.registry)
    assert str(info.value) == (
        "[model] attention_backend: must be one of 'auto', 'sdpa', 'flex', 'eager', got 'flash'."
    )
    # The config's choices are the model's (the schema names them without importing torch).
    assert ", ".join(repr(backend) for backend in ATTENTION_BACKENDS) in str(info.value)
    for backend in ATTENTION_BACKENDS:
        config = load_config(None, [f"--model.attention_backend={backend}"], manager.registry)
        assert config.model.options.attention_backend == backend


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_block_takes_each_forwards_new_block_mask_without_recompiling(make_model):
    """``[train] compile`` compiles each block, which then receives a new BlockMask (a new
    ``mask_mod`` closure over new document ids) every step: one graph, no graph break and no
    recompilation, or every step would compile again. Dynamo's counting backend stands in for
    inductor (the same tracing and guards, without code generation)."""
    model = make_model(attention_backend="flex")
    expected = make_model(attention_backend="sdpa")
    counter = CompileCounter()
    for block in model.layers:
        block.compile(backend=counter)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        for length in (7, 11, 16):
            documents = (torch.arange(40) // length).expand(2, 40)
            assert_within_ulps(model(ids, documents), expected(ids, documents), 8)
    assert counter.frame_count == 1
    assert not counters["graph_break"]


# -- eager attention --------------------------------------------------------------------------


@pytest.mark.parametrize("fields", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
@pytest.mark.parametrize("packed", [True, False], ids=["packed-documents", "causal"])
def test_eager_logits_and_gradients_equal_sdpa(make_model, fields, packed):
    """Eager attention against SDPA's kernels, forward and backward, with packed documents and
    plain causal attention (where SDPA takes its fused causal kernel). Tolerance: 8 float32 ulps
    of the largest logit, 16 of each parameter's largest gradient, as for FlexAttention."""
    documents = packed_documents() if packed else None
    mask, is_causal = attention_mask(documents, 0, SEQ, CPU, "eager")
    assert mask.dtype == torch.float32
    assert not is_causal
    train_step_against_sdpa(make_model, "eager", fields, documents)


def test_eager_bf16_stays_within_a_bf16_rounding_of_sdpa(make_model):
    """Under bf16 autocast eager attention rounds its probabilities to bf16 before the product
    with the values (SDPA's kernel keeps them in fp32): against the float64 reference, its logits
    may be off by a bf16 rounding more than SDPA's, not by more."""
    models = {backend: make_model(attention_backend=backend, max_seq_len=SEQ) for backend in ("sdpa", "eager")}
    documents = [0] * 40 + [1] * 60 + [2] * 28
    ids = torch.randint(0, VOCAB, (1, len(documents)), generator=torch.Generator().manual_seed(9))
    expected = reference_logits(models["sdpa"], ids[0].tolist(), documents)
    error = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for backend, model in models.items():
            error[backend] = (model(ids, torch.tensor([documents]))[0].double() - expected).abs().max().item()
    bf16_rounding = torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
    assert error["eager"] <= error["sdpa"] + bf16_rounding, error
    assert error["eager"] > 0  # it did run in bf16


def bf16_attention_inputs(seed: int = 11) -> tuple[torch.Tensor, ...]:
    """Queries, keys, values and an output gradient ``[2, 4, 96, 32]`` in bf16, and packed
    documents ``[2, 96]`` (two documents in the first row, one in the second)."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(2, 4, 96, 32, generator=generator).bfloat16() for _ in range(4))
    documents = torch.stack([(torch.arange(96) >= 50).long(), torch.zeros(96, dtype=torch.long)])
    return q, k, v, grad, documents


def test_eager_bf16_probabilities_are_the_fp32_softmax_rounded_once():
    """In bf16 the bias is bf16 and the softmax runs on the bf16 scores: the output is bitwise
    that of the fp32 softmax of the same scores, rounded to bf16 before the product with v."""
    q, k, v, _, documents = bf16_attention_inputs()
    bias, _ = attention_mask(documents, 0, 96, CPU, "eager", torch.bfloat16)
    assert bias.dtype == torch.bfloat16
    scores = torch.matmul(q * 32**-0.5, k.transpose(-2, -1))
    fp32_bias, _ = attention_mask(documents, 0, 96, CPU, "eager", torch.float32)
    probs = torch.softmax(scores.float() + fp32_bias, dim=-1).bfloat16()
    assert torch.equal(attention.eager_attention(q, k, v, bias), torch.matmul(probs, v))


def test_eager_bf16_gradients_stay_within_a_bf16_rounding_of_sdpa():
    """Eager attention's backward in bf16 works from the rounded probabilities: against the
    float64 gradients, each input's gradient may be off by a bf16 rounding more than SDPA's (which
    keeps fp32 probabilities), not by more."""
    q, k, v, grad, documents = bf16_attention_inputs()
    allowed, _ = attention_mask(documents, 0, 96, CPU, "sdpa")
    bias, _ = attention_mask(documents, 0, 96, CPU, "eager", torch.bfloat16)

    def gradients(kernel, dtype: torch.dtype) -> list[torch.Tensor]:
        inputs = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        kernel(*inputs).backward(grad.to(dtype))
        return [t.grad.double() for t in inputs]

    expected = gradients(lambda *t: attention.eager_attention(*t, bias.double()), torch.float64)
    eager = gradients(lambda *t: attention.eager_attention(*t, bias), torch.bfloat16)
    sdpa = gradients(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=allowed), torch.bfloat16)
    for name, reference, mine, theirs in zip("qkv", expected, eager, sdpa, strict=True):
        rounding = torch.finfo(torch.bfloat16).eps * reference.abs().max().item()
        error, sdpa_error = ((g - reference).abs().max().item() for g in (mine, theirs))
        assert error <= sdpa_error + rounding, (name, error, sdpa_error, rounding)


def test_eager_decoding_over_a_kv_cache_continues_the_full_forward(make_model):
    """A prompt, then several new tokens at once (a [T, start + T] bias), then one token (no
    bias): each step's logits are the full sequence's at those positions."""
    model = make_model(attention_backend="eager")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    cache = KVCache(max_len=12)
    with torch.no_grad():
        full = model(ids)
        pieces = [
            model(ids[:, :5], kv_cache=cache),
            model(ids[:, 5:11], kv_cache=cache),
            model(ids[:, 11:], kv_cache=cache),
        ]
    assert_within_ulps(torch.cat(pieces, dim=1), full, 8)
    mask, _ = attention_mask(None, 5, 6, CPU, "eager")
    assert mask.shape == (6, 11)
    assert mask.dtype == torch.float32
    assert attention_mask(None, 11, 1, CPU, "eager") == (None, False)


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "keys", "eager"),
    [
        ("auto", "cpu", torch.float32, 128, True),
        ("auto", "cpu", torch.float32, 129, False),
        ("auto", "cpu", torch.bfloat16, 512, True),
        ("auto", "cpu", torch.bfloat16, 513, False),
        ("auto", "cpu", torch.float16, 128, True),  # not measured: fp32's limit
        ("auto", "cpu", torch.float16, 129, False),
        ("auto", "cuda", torch.bfloat16, 1, False),
        ("sdpa", "cpu", torch.float32, 1, False),
        ("flex", "cpu", torch.float32, 1, False),
        ("eager", "cuda", torch.float32, 1 << 20, True),
    ],
)
def test_auto_takes_eager_attention_on_cpu_up_to_its_measured_length(backend, device, dtype, keys, eager):
    assert {torch.float32: 128, torch.bfloat16: 512} == EAGER_MAX_KEYS  # as the README and config help state
    assert uses_eager(backend, torch.device(device), keys, dtype) is eager


@pytest.mark.parametrize(("seq", "precision", "eager_calls"), [(128, None, 4), (129, None, 0), (200, "bf16", 4)])
def test_the_model_takes_the_path_auto_picks(make_model, monkeypatch, seq, precision, eager_calls):
    """Through the model: on CPU ``auto`` runs every layer eagerly up to the measured length of
    the compute dtype (bf16 under autocast) and through SDPA beyond it."""
    calls: list[str] = []
    monkeypatch.setattr(attention, "eager_attention", counting(calls, "eager", attention.eager_attention))
    monkeypatch.setattr(
        attention.F, "scaled_dot_product_attention", counting(calls, "sdpa", F.scaled_dot_product_attention)
    )
    model = make_model(attention_backend="auto", n_layers=4, max_seq_len=seq)
    ids = torch.zeros(2, seq, dtype=torch.long)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        model(ids)
    assert calls.count("eager") == eager_calls
    assert calls.count("sdpa") == 4 - eager_calls
