"""Causal self-attention with grouped-query heads, optional QK-norm and RoPE, and its masks.

The causal mask, and for packed documents (``document_ids``) the mask that keeps a token within
its own document, takes one of three forms, chosen once per forward by :func:`attention_mask`
(``[model] attention_backend``):

- ``"sdpa"``: ``F.scaled_dot_product_attention``, with a dense boolean ``[B, 1, T, T]`` mask
  for packed documents and its fused causal kernels otherwise. On CUDA the dense mask rules out
  SDPA's flash kernel.
- ``"flex"``: a FlexAttention :class:`~torch.nn.attention.flex_attention.BlockMask`, which
  records which 128 x 128 tiles are empty, full or partial, so the fused kernel skips the empty
  ones. FlexAttention is only fused when compiled: on CUDA both ``flex_attention`` and
  ``create_block_mask`` are compiled once per process; elsewhere they run eagerly, which is
  exact but several times slower than the dense mask, and torch has no FlexAttention backward
  on CPU, so there it serves evaluation only.
- ``"eager"``: attention written out (:func:`eager_attention`): the scores as one batched
  matrix product, an additive ``0 / -inf`` mask built once per forward, softmax computed in fp32. It
  holds every ``[T, T]`` score matrix at once, so it suits short sequences only; on CPU it is
  faster there than SDPA's CPU flash kernel, whose backward is slow at short lengths and slower
  still in bf16 (``benchmarks/bench_train.py`` times both at several lengths).
- ``"auto"`` (the default): ``"flex"`` on CUDA; on CPU ``"eager"`` up to
  :data:`EAGER_MAX_KEYS` keys (the lengths where it measured faster), ``"sdpa"`` beyond.

A sliding window (:class:`SlidingWindowAttention`, ``window = W``) narrows any of these masks:
query ``i`` sees key ``j`` only when ``i - W < j``. The model builds that mask once per forward
for each window its layers declare. The KV cache still keeps every key (the mask hides the old
ones), so decoding is exact but its memory grows with the whole length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from forge_lm.errors import ForgeError
from forge_lm.model.kv_cache import KVCache
from forge_lm.model.linear import Linear
from forge_lm.model.norms import RMSNorm
from forge_lm.model.rope import apply_rope

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from forge_lm.components import AttentionSpec, Initializer


class SequenceGather(Protocol):
    """All that attention needs of context parallelism: every rank's slice of the sequence,
    concatenated along ``dim`` in rank order, differentiably (the gradients of every rank's
    queries flow back to the rank that owns the keys). Implemented by
    :class:`forge_lm.distributed.context_parallel.ContextParallel`, which the model hands to its
    attention layers (:meth:`forge_lm.model.transformer.Transformer.set_context_parallel`)."""

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...


class Attention(nn.Module):
    """``wq``/``wk``/``wv`` project to ``n_heads`` query and ``n_kv_heads`` key/value heads; ``wo`` projects back.

    With ``n_kv_heads < n_heads`` (grouped-query attention) each key/value head serves
    ``n_heads / n_kv_heads`` consecutive query heads, the layout of HF Llama. No biases.

    Under context parallelism (``context_parallel`` set, see
    :mod:`forge_lm.distributed.context_parallel`) ``x`` is this rank's slice of the sequence: the
    keys and values of the whole group are gathered before attending, and ``mask`` is over the
    gathered keys.
    """

    context_parallel: SequenceGather | None = None

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        layer_index: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        head_dim: int | None = None,
    ) -> None:
        super().__init__()
        # head_dim: each head's size, dim // n_heads unless given (Qwen3 sets it apart from dim).
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = head_dim if head_dim is not None else dim // n_heads
        self.layer_index = layer_index  # its slot in a KV cache
        self.wq = Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = Linear(n_heads * self.head_dim, dim, bias=False)  # writes into the residual stream
        # QK-norm: one RMSNorm scale over head_dim, shared by all heads, applied before RoPE.
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | None,
        is_causal: bool,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``x`` ``[batch, seq, dim]`` -> ``[batch, seq, dim]``; ``cos``/``sin`` ``[seq, head_dim]`` for its positions.

        ``mask`` and ``is_causal`` come from :func:`attention_mask` (or :func:`positional_mask`):
        a boolean tensor (True = may attend) goes to SDPA, a float one (added to the scores) to
        :func:`eager_attention`, a ``BlockMask`` to FlexAttention.
        """
        batch, seq, _ = x.shape
        # Head counts come from the projections' outputs, not from n_heads / n_kv_heads: under
        # tensor parallelism wq/wk/wv hold this rank's heads only (n_heads / tp and n_kv_heads / tp).
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, Dh]
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, Dh]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_index, k, v)  # [B, KV, S, Dh], S = cached + T
        if self.context_parallel is not None:  # after RoPE (global positions), before repeat_kv (fewer heads)
            k, v = self.context_parallel.gather(k, dim=2), self.context_parallel.gather(v, dim=2)  # [B, KV, T*cp, Dh]
        # The group size n_heads / n_kv_heads is the same on local heads (tp divides both).
        groups = self.n_heads // self.n_kv_heads
        if isinstance(mask, BlockMask):
            # FlexAttention maps query head h to key/value head h // groups itself (the layout of
            # repeat_kv), so the repeated keys and values are never materialised.
            check_flex_backward(q)
            out = flex_function(q.device)(q, k, v, block_mask=mask, enable_gqa=groups > 1)  # [B, H, T, Dh]
        elif mask is not None and mask.is_floating_point():
            out = eager_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), mask)  # [B, H, T, Dh]
        else:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)  # [B, H, T, Dh]
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """Heads split over the ``tp`` ranks: ``wq``/``wk``/``wv`` by output (column parallel),
        so each rank attends with its own heads over the whole sequence; ``wo`` by input (row
        parallel), its partial sums reduce-scattered along the sequence."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {
            "wq": ColwiseParallel(),
            "wk": ColwiseParallel(),
            "wv": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=Shard(1)),
        }

    def init_weights(self, init: Initializer) -> None:
        """Projections ``normal(0, init.std)``, the residual projection ``wo``
        ``normal(0, init.residual_std)``, the QK-norm scales 1."""
        for linear in (self.wq, self.wk, self.wv):
            init.normal(linear.weight, init.std)
        init.normal(self.wo.weight, init.residual_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                init.ones(norm.weight)


class SlidingWindowAttention(Attention):
    """:class:`Attention` whose queries see only the ``window`` most recent keys, themselves
    included (Mistral's sliding window). The layer is the same; the model builds its mask
    (:class:`~forge_lm.components.WindowedAttention`)."""

    def __init__(self, *args: object, window: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.window = window


def build_gqa(options: object, spec: AttentionSpec, layer_index: int) -> Attention:
    """The ``gqa`` attention component."""
    return Attention(
        spec.dim,
        spec.n_heads,
        spec.n_kv_heads,
        layer_index,
        qk_norm=spec.qk_norm,
        norm_eps=spec.norm_eps,
        head_dim=spec.head_dim,
    )


def build_sliding_window(options: object, spec: AttentionSpec, layer_index: int) -> SlidingWindowAttention:
    """The ``sliding_window`` attention component (options: ``window``)."""
    return SlidingWindowAttention(
        spec.dim,
        spec.n_heads,
        spec.n_kv_heads,
        layer_index,
        qk_norm=spec.qk_norm,
        norm_eps=spec.norm_eps,
        head_dim=spec.head_dim,
        window=options.window,
    )


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, KV, S, Dh]`` -> ``[B, KV * groups, S, Dh]``: key/value head ``j`` serves query heads ``j*groups ...``.

    Explicit rather than SDPA's ``enable_gqa`` so that every SDPA backend (and a custom mask) accepts it.
    """
    if groups == 1:
        return x
    batch, heads, seq, head_dim = x.shape
    return x[:, :, None].expand(batch, heads, groups, seq, head_dim).reshape(batch, heads * groups, seq, head_dim)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(Dh) + bias) v`` written out; ``q`` ``[B, H, T, Dh]``, ``k``/``v``
    ``[B, H, S, Dh]``, ``bias`` broadcastable to ``[B, H, T, S]`` (0 where a query may attend,
    ``-inf`` elsewhere; every row has a 0).

    Everything runs in the inputs' dtype (bf16 under autocast). The bias is added in that dtype
    (adding 0 or ``-inf`` is exact in any of them), and torch's softmax kernels compute a bf16 or
    fp16 input in fp32 and round the probabilities once: they are bitwise those of an fp32
    softmax cast back to bf16, as in HF's eager attention. The backward pass works from those
    rounded probabilities (about one bf16 rounding from an fp32 softmax's gradient), and no
    [B, H, T, S] tensor is ever converted: in bf16 on CPU this is 1.5x to 2.5x faster, forward and
    backward, than upcasting the scores. SDPA's fused kernels keep the probabilities in fp32: in
    bf16 this path's outputs are about one bf16 rounding further from the exact ones.
    """
    # The scale goes on q, the smaller operand when S > Dh; a power of two for usual head sizes.
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1))
    probs = torch.softmax(scores + bias.to(scores.dtype), dim=-1)
    return torch.matmul(probs, v)


ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "eager")

# The longest key length at which "auto" picks eager attention on CPU, per compute dtype.
# Measured on the AMD EPYC development machine (forward + backward with a document mask, SDPA's
# CPU flash kernel against eager_attention; benchmarks/bench_train.py's attention table): in
# fp32 eager is 0.96x to 1.25x as fast up to 128 keys (even, within the machine's noise) and
# between 0.8x and 1.19x beyond, run to run; in bf16 (scores kept in bf16, see eager_attention)
# 2x to 5x faster up to 384 keys, 1.3x to 2.9x at 512, and at 768 between 0.9x and 2.5x. The
# bf16 limit is the longest length at which eager won in every run; the fp32 one, where it won
# in all but one. Eager attention keeps every head's [T, S] probabilities for the
# backward pass, which SDPA's kernel does not: memory that grows with the square of the length
# (forge_lm.model.memory.eager_attention_bytes_per_token counts it).
EAGER_MAX_KEYS = {torch.float32: 128, torch.bfloat16: 512}


def is_cuda(device: torch.device) -> bool:
    """Whether ``device`` runs compiled (fused) FlexAttention; one place, so tests can stand in for CUDA."""
    return device.type == "cuda"


def _check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")


def uses_flex(backend: str, device: torch.device) -> bool:
    """Whether a document mask on ``device`` is a FlexAttention ``BlockMask`` under ``backend``
    (``[model] attention_backend``): ``"auto"`` picks FlexAttention where it is compiled (CUDA)."""
    _check_backend(backend)
    return backend == "flex" or (backend == "auto" and is_cuda(device))


def uses_eager(backend: str, device: torch.device, keys: int, dtype: torch.dtype) -> bool:
    """Whether attention over ``keys`` keys computed in ``dtype`` on ``device`` is written out
    (:func:`eager_attention`) under ``backend``: always for ``"eager"``; for ``"auto"`` on CPU up
    to :data:`EAGER_MAX_KEYS` keys of the dtype (128 for dtypes not measured)."""
    _check_backend(backend)
    if backend == "auto":
        return device.type == "cpu" and keys <= EAGER_MAX_KEYS.get(dtype, EAGER_MAX_KEYS[torch.float32])
    return backend == "eager"


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype attention's products run in: autocast's on ``device`` when it is on, else fp32."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32


def flex_function(device: torch.device) -> Callable[..., torch.Tensor]:
    """``flex_attention`` for ``device``: compiled (the fused kernel) on CUDA, eager elsewhere.

    Eager FlexAttention computes every score and then masks it (exact, but slow); compiled for
    CPU it costs seconds per shape, runs no faster than SDPA's dense mask and still has no
    backward, so CPU keeps the eager function.
    """
    return _compiled(flex_attention) if is_cuda(device) else flex_attention


def check_flex_backward(query: torch.Tensor) -> None:
    """Refuse to train through FlexAttention where torch has no backward for it (CPU, MPS), with
    the fix; torch's own NotImplementedError would come without one."""
    if query.requires_grad and query.device.type in ("cpu", "mps"):
        raise ForgeError(
            f"[model] attention_backend = 'flex' cannot train on {query.device.type}: torch's FlexAttention "
            "has no backward there. Use 'auto' or 'sdpa' (evaluation without gradients works with 'flex')."
        )


@functools.cache
def _compiled(function: Callable[..., object]) -> Callable[..., object]:
    # Compiled once per process and shared by every layer and model: torch.compile caches its
    # graphs on the returned wrapper, so a fresh wrapper per call would recompile every time.
    return torch.compile(function)


def document_block_mask(
    document_ids: torch.Tensor | None,
    window: int | None = None,
    *,
    seq: int | None = None,
    device: torch.device | None = None,
) -> BlockMask:
    """The FlexAttention ``BlockMask`` of packed documents ``[B, T]``: query ``i`` sees key ``j``
    iff ``j <= i`` and both belong to the same document; the same for every head. With a
    ``window``, also only iff ``i - window < j``; without documents (``seq`` and ``device``
    given instead) the mask is causal (and windowed) for every row.

    Built once per forward and shared by all layers. On CUDA ``create_block_mask`` is compiled,
    as torch recommends for a mask built every step; eagerly it evaluates the ``mask_mod`` on a
    dense ``[B, T, T]`` grid.
    """
    if document_ids is not None:
        batch, seq = document_ids.shape
        device = document_ids.device
    elif seq is None or device is None:
        raise ValueError("document_block_mask needs document_ids, or seq and device")
    else:
        batch = None

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        allowed = kv <= q
        if document_ids is not None:
            allowed = allowed & (document_ids[b, q] == document_ids[b, kv])
        if window is not None:
            allowed = allowed & (q - kv < window)
        return allowed

    build = _compiled(create_block_mask) if is_cuda(device) else create_block_mask
    return build(visible, batch, None, seq, seq, device=device)


def attention_mask(
    document_ids: torch.Tensor | None,
    start: int,
    length: int,
    device: torch.device,
    backend: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> tuple[torch.Tensor | BlockMask | None, bool]:
    """``(mask, is_causal)`` for ``length`` queries at positions ``[start, start + length)``,
    attention computed in ``dtype`` (:func:`compute_dtype`); with a ``window``, each query sees
    only the ``window`` most recent keys (itself included) as well.

    - No documents, no cached prefix: plain causal attention (``is_causal``, no mask tensor, so
      SDPA can use its fused kernels).
    - ``document_ids`` ``[B, T]`` (packed sequences): query ``i`` sees key ``j`` iff ``j <= i``
      and both belong to the same document, as a FlexAttention ``BlockMask``
      (:func:`document_block_mask`) when :func:`uses_flex` says so for ``backend`` on
      ``device``, else as a boolean ``[B, 1, T, T]`` SDPA mask. Every query sees at least
      itself, so no row is empty. RoPE is relative, so documents need no position reset. When
      every row holds one document the mask is plain causal attention, and is dropped so that
      SDPA can use its fused causal kernels (documents much longer than a sequence, the common
      case, make most batches like that).
    - A cached prefix (``start > 0``): one new token sees every key (no mask); several new tokens
      get a ``[T, start + T]`` mask where query ``i`` sees keys ``j <= start + i`` (SDPA's
      ``is_causal`` would align the triangle to the top-left corner instead).

    Where :func:`uses_eager` says so, any of these masks (causal attention included) comes as
    the float ``0 / -inf`` bias :func:`eager_attention` adds to its scores, with ``is_causal``
    False; one new token over a cached prefix still needs none.
    """
    if window is not None and window < start + length:  # else the window hides nothing
        mask, is_causal = _windowed_mask(document_ids, start, length, device, backend, window), False
    else:
        mask, is_causal = _boolean_mask(document_ids, start, length, device, backend)
    if isinstance(mask, BlockMask) or not uses_eager(backend, device, start + length, dtype):
        return mask, is_causal
    if is_causal:
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if mask is None:
        return None, False
    # In the compute dtype: eager_attention adds it to scores of that dtype.
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf")), False


def _boolean_mask(
    document_ids: torch.Tensor | None, start: int, length: int, device: torch.device, backend: str
) -> tuple[torch.Tensor | BlockMask | None, bool]:
    if document_ids is not None and not bool((document_ids == document_ids[:, :1]).all()):
        if uses_flex(backend, device):
            return document_block_mask(document_ids), False
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        same_document = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
        return (same_document & causal)[:, None], False
    if start == 0:
        return None, True
    if length == 1:
        return None, False
    query_pos = torch.arange(start, start + length, device=device)[:, None]
    key_pos = torch.arange(start + length, device=device)[None, :]
    return key_pos <= query_pos, False


def _windowed_mask(
    document_ids: torch.Tensor | None, start: int, length: int, device: torch.device, backend: str, window: int
) -> torch.Tensor | BlockMask:
    """The causal (and same-document) mask, narrowed to keys ``j > i - window``: a BlockMask
    where FlexAttention is used and nothing is cached, else a boolean ``[T, S]`` (or
    ``[B, 1, T, T]`` with documents) SDPA mask."""
    if document_ids is not None and bool((document_ids == document_ids[:, :1]).all()):
        document_ids = None  # one document per row: causal
    if start == 0 and uses_flex(backend, device):
        return document_block_mask(document_ids, window, seq=length, device=device)
    query_pos = torch.arange(start, start + length, device=device)[:, None]
    key_pos = torch.arange(start + length, device=device)[None, :]
    visible = (key_pos <= query_pos) & (query_pos - key_pos < window)  # [T, S]
    if document_ids is None:
        return visible
    same_document = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T] (start is 0)
    return (same_document & visible)[:, None]


def positional_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    query_documents: torch.Tensor | None,
    key_documents: torch.Tensor | None,
    window: int | None = None,
) -> torch.Tensor:
    """A boolean SDPA mask (True = may attend) from global positions: query ``i`` sees key ``j``
    iff ``key_positions[j] <= query_positions[i]`` and, with documents ``[B, Tq]``/``[B, Tk]``,
    both belong to the same one. ``[Tq, Tk]``, or ``[B, 1, Tq, Tk]`` with documents. Each query
    sees at least its own key, so no row is empty. With a ``window``, also only iff
    ``query_positions[i] - key_positions[j] < window``. For tokens held in any order, such as a
    context-parallel rank's slice and the keys gathered from its group.

    Context parallelism keeps this dense SDPA mask whatever ``attention_backend`` says: its
    queries are a rank's two chunks and its keys the whole gathered sequence, so the mask is
    built from those global positions rather than from :func:`document_block_mask`."""
    causal = key_positions[None, :] <= query_positions[:, None]  # [Tq, Tk]
    if window is not None:
        causal = causal & (query_positions[:, None] - key_positions[None, :] < window)
    if query_documents is None or key_documents is None:
        return causal
    same_document = query_documents[:, :, None] == key_documents[:, None, :]  # [B, Tq, Tk]
    return (same_document & causal)[:, None]
