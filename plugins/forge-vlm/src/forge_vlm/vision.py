"""The vision tower: a ViT encoder (``[model.vision]``, :class:`~forge_vlm.options.ViTOptions`).

Layout, as CLIP's and SigLIP's vision towers: patch embedding (a strided convolution), an
optional class token, learned position embeddings (or 2-D rotary positions in attention), an
optional layer norm (CLIP's ``pre_layrnorm``), then ``depth`` pre-norm blocks
(``x + attention(norm1(x))``, ``x + mlp(norm2(x))``, bidirectional attention, biases
everywhere). :meth:`VisionTower.forward` returns the hidden state that ``feature_layer`` names
(0: the embeddings, k: block k's output), with the first position dropped when
``feature_select = "default"``: what Llava's ``get_image_features`` selects. Parameter names
follow Hugging Face's (``embeddings.patch_embedding``, ``blocks.N.self_attn.q_proj``) so the
conversion in :func:`hf_vision_state` is a renaming.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from forge_lm.errors import ForgeError
from forge_vlm.options import ViTOptions

if TYPE_CHECKING:
    from forge_lm.components import Initializer


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP activations CLIP (``quick_gelu``), SigLIP (``gelu_tanh``) and Llava's projector use."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over an image's positions, with biases."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, seq, width = x.shape

        def split(projection: nn.Linear) -> torch.Tensor:
            return projection(x).view(batch, seq, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj), split(self.k_proj), split(self.v_proj)
        if rotary is not None:
            q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        out = F.scaled_dot_product_attention(q, k, v)  # every position sees every other
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, width))

    def init_weights(self, init: Initializer) -> None:
        for projection in (self.q_proj, self.k_proj, self.v_proj):
            init.normal(projection.weight, init.std)
            init.zeros(projection.bias)
        init.normal(self.out_proj.weight, init.residual_std)
        init.zeros(self.out_proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))

    def init_weights(self, init: Initializer) -> None:
        init.normal(self.fc1.weight, init.std)
        init.zeros(self.fc1.bias)
        init.normal(self.fc2.weight, init.residual_std)
        init.zeros(self.fc2.bias)


class VisionBlock(nn.Module):
    """One pre-norm encoder block (CLIP's and SigLIP's ``EncoderLayer``)."""

    def __init__(self, options: ViTOptions) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(options.width, eps=options.norm_eps)
        self.self_attn = VisionAttention(options.width, options.heads)
        self.layer_norm2 = nn.LayerNorm(options.width, eps=options.norm_eps)
        self.mlp = VisionMLP(options.width, options.hidden_dim, options.activation)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), rotary)
        return x + self.mlp(self.layer_norm2(x))

    def init_weights(self, init: Initializer) -> None:
        for norm in (self.layer_norm1, self.layer_norm2):
            init.ones(norm.weight)
            init.zeros(norm.bias)
        init.module(self.self_attn)
        init.module(self.mlp)


class VisionEmbeddings(nn.Module):
    """Patches -> vectors, the class token in front, learned positions added (none with rope2d)."""

    def __init__(self, options: ViTOptions) -> None:
        super().__init__()
        self.options = options
        self.patch_embedding = nn.Conv2d(
            options.channels,
            options.width,
            kernel_size=options.patch_size,
            stride=options.patch_size,
            bias=options.patch_bias,
        )
        self.class_embedding = nn.Parameter(torch.empty(options.width)) if options.class_token else None
        self.position_embedding = (
            nn.Embedding(options.positions_per_image, options.width) if options.positions == "learned" else None
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [N, width, grid, grid]
        x = patches.flatten(2).transpose(1, 2)  # [N, grid * grid, width], row by row
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        if self.position_embedding is not None:
            x = x + self.position_embedding.weight.to(x.dtype)
        return x

    def init_weights(self, init: Initializer) -> None:
        init.normal(self.patch_embedding.weight, init.std)
        if self.patch_embedding.bias is not None:
            init.zeros(self.patch_embedding.bias)
        if self.class_embedding is not None:
            init.normal(self.class_embedding, init.std)
        if self.position_embedding is not None:
            init.normal(self.position_embedding.weight, init.std)


class VisionTower(nn.Module):
    """The ViT encoder of ``options``. ``forward(pixel_values [N, C, H, W]) -> [N, tokens, width]``:
    the selected features of each image (see the module docstring).

    Only the blocks the features need are built (``feature_layer`` -2 of a 24-block CLIP: 23):
    the later ones cannot change them, as in Llava, where they run for nothing."""

    def __init__(self, options: ViTOptions, checkpoint: str | None = None) -> None:
        super().__init__()
        self.options = options
        self.checkpoint = checkpoint  # a HF vision checkpoint directory whose weights init_weights copies
        self.embeddings = VisionEmbeddings(options)
        self.pre_layrnorm = nn.LayerNorm(options.width, eps=options.norm_eps) if options.pre_norm else None
        self.blocks = nn.ModuleList(VisionBlock(options) for _ in range(options.feature_index))
        if options.positions == "rope2d":
            self.register_buffer("rope_cos", torch.empty(options.positions_per_image, self._head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(options.positions_per_image, self._head_dim), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None

    @property
    def _head_dim(self) -> int:
        return self.options.width // self.options.heads

    def check_pixels(self, pixel_values: torch.Tensor) -> None:
        """Images of another size or channel count than the tower's are refused, naming both."""
        o = self.options
        wanted = (o.channels, o.image_size, o.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != wanted:
            raise ForgeError(
                f"pixel_values of shape {list(pixel_values.shape)}: the vision tower takes images "
                f"[num_images, {o.channels}, {o.image_size}, {o.image_size}] ([model.vision] channels, image_size); "
                "resize the images (the image-text datasets do) or change [model.vision]."
            )
        if not pixel_values.is_floating_point():
            raise ForgeError(
                f"pixel_values of dtype {pixel_values.dtype}: images are normalised floats (mean/std applied)."
            )

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """The embeddings (after ``pre_layrnorm``) and each built block's output, ``[N, P, width]``."""
        self.check_pixels(pixel_values)
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        rotary = (self.rope_cos.to(x.dtype), self.rope_sin.to(x.dtype)) if self.rope_cos is not None else None
        states = [x]
        for block in self.blocks:
            x = block(x, rotary)
            states.append(x)
        return states

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.hidden_states(pixel_values)[-1]
        return features[:, 1:] if self.options.feature_select == "default" else features

    def init_weights(self, init: Initializer) -> None:
        init.module(self.embeddings)
        if self.pre_layrnorm is not None:
            init.ones(self.pre_layrnorm.weight)
            init.zeros(self.pre_layrnorm.bias)
        for block in self.blocks:
            init.module(block)
        if self.rope_cos is not None:
            cos, sin = rope_2d_tables(self.options)
            init.copy(self.rope_cos, cos)
            init.copy(self.rope_sin, sin)
        if self.checkpoint is not None:  # through init.copy: each rank writes its shards, on any layout
            state = read_vision_checkpoint(self.checkpoint, self.options)
            check_fits(self, state, f"the vision checkpoint {self.checkpoint}")
            own = dict(self.named_parameters())
            for name, values in state.items():
                init.copy(own[name], values.float())


def rope_2d_tables(options: ViTOptions, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[positions, head_dim]``: the first half of each head turns with the patch's
    row, the second half with its column (axial 2-D RoPE); the class token is not turned."""
    head_dim = options.width // options.heads
    quarter = head_dim // 4
    inverse = 1.0 / theta ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(options.grid), torch.arange(options.grid), indexing="ij")
    angles = torch.cat([rows.flatten()[:, None] * inverse, cols.flatten()[:, None] * inverse], dim=1)
    angles = torch.cat([angles, angles], dim=1)  # [grid * grid, head_dim]: rotate-half pairs
    if options.class_token:
        angles = torch.cat([torch.zeros(1, head_dim, dtype=angles.dtype), angles])
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def vision_flops_per_image(options: ViTOptions, blocks: int) -> float:
    """Training FLOPs (forward and backward) of one image through ``blocks`` blocks: 6 per weight
    of each matmul and position, plus attention's scores and values over every position pair."""
    positions, width = options.positions_per_image, options.width
    patch = options.channels * options.patch_size**2 * width * options.grid**2
    per_block = positions * (4 * width * width + 2 * width * options.hidden_dim)
    attention = 2 * positions * positions * width  # QK^T and AV: 2 matmuls of P x P x width
    return 6.0 * patch + blocks * (6.0 * per_block + 6.0 * attention)


# -- Hugging Face CLIP / SigLIP vision weights ----------------------------------------------------

_HF_BLOCK_NAMES = {
    "layer_norm1": "layer_norm1",
    "layer_norm2": "layer_norm2",
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj",
    "self_attn.out_proj": "self_attn.out_proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def hf_vision_state(state: Mapping[str, torch.Tensor], prefix: str, options: ViTOptions) -> dict[str, torch.Tensor]:
    """A tower's state dict (:class:`VisionTower` names) from a Hugging Face CLIP or SigLIP vision
    model's tensors under ``prefix`` (``"vision_model."``). Blocks after the features and heads
    (SigLIP's ``head``, CLIP's ``post_layernorm``, which Llava does not use) are left out."""
    out: dict[str, torch.Tensor] = {}

    def take(hf_name: str, name: str, *, reshape: tuple[int, ...] | None = None) -> None:
        key = prefix + hf_name
        if key not in state:
            raise ForgeError(f"the vision checkpoint has no tensor '{key}', which [model.vision] needs.")
        tensor = state[key]
        out[name] = tensor.reshape(reshape) if reshape is not None else tensor

    take("embeddings.patch_embedding.weight", "embeddings.patch_embedding.weight")
    if options.patch_bias:
        take("embeddings.patch_embedding.bias", "embeddings.patch_embedding.bias")
    if options.class_token:
        take("embeddings.class_embedding", "embeddings.class_embedding")
    if options.positions == "learned":
        take("embeddings.position_embedding.weight", "embeddings.position_embedding.weight")
    if options.pre_norm:
        take("pre_layrnorm.weight", "pre_layrnorm.weight")
        take("pre_layrnorm.bias", "pre_layrnorm.bias")
    for index in range(options.feature_index):
        for hf_name, name in _HF_BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                take(f"encoder.layers.{index}.{hf_name}.{kind}", f"blocks.{index}.{name}.{kind}")
    return out


def to_hf_vision_state(tower: VisionTower, prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_vision_state`: Hugging Face names under ``prefix``."""
    out = {}
    for name, tensor in tower.state_dict().items():
        hf_name = name.replace("blocks.", "encoder.layers.", 1) if name.startswith("blocks.") else name
        out[prefix + hf_name] = tensor
    return out


def check_fits(tower: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse weights whose shapes differ from the tower's, naming the first few."""
    own = dict(tower.state_dict())
    wrong = [
        f"{name} {list(tensor.shape)} (the tower's: {list(own[name].shape)})"
        for name, tensor in state.items()
        if name in own and tuple(tensor.shape) != tuple(own[name].shape)
    ]
    if wrong:
        shown = "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        raise ForgeError(
            f"{where} does not fit [model.vision]: {shown}. Set [model.vision] (width, depth, heads, patch_size, "
            "image_size, mlp_dim, class_token) to the checkpoint's sizes."
        )


def read_vision_checkpoint(path: str | Path, options: ViTOptions) -> dict[str, torch.Tensor]:
    """The tower's weights from a Hugging Face CLIP or SigLIP vision checkpoint directory (its
    ``*.safetensors`` files), checked against ``options``; what a bad or mismatched checkpoint
    is, is named."""
    from safetensors.torch import load_file

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise ForgeError(
            f"[model] vision_checkpoint = '{path}' holds no *.safetensors files; give a Hugging Face CLIP or SigLIP "
            "(vision) model directory saved with save_pretrained."
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file is named, whatever failed
            raise ForgeError(f"cannot read the vision checkpoint file {file}: {exc}") from None
    prefix = _vision_prefix(state, path)
    _check_config(folder, options)
    return hf_vision_state(state, prefix, options)


def _vision_prefix(state: Mapping[str, torch.Tensor], path: str | Path) -> str:
    """Where the vision model's tensors are: a ``CLIPVisionModel`` / ``SiglipVisionModel``
    (``vision_model.``), or a whole CLIP / SigLIP model (the same, beside its text model)."""
    for prefix in ("vision_model.", "model.vision_model.", ""):
        if f"{prefix}embeddings.patch_embedding.weight" in state:
            return prefix
    raise ForgeError(
        f"the vision checkpoint {path} has no CLIP or SigLIP vision tower (no '...embeddings.patch_embedding.weight')."
    )


def _check_config(folder: Path, options: ViTOptions) -> None:
    """The checkpoint's config.json (if any) against [model.vision]: the settings shapes cannot show."""
    file = folder / "config.json"
    if not file.is_file():
        return
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ForgeError(f"cannot read {file}: {exc}") from None
    vision = config.get("vision_config", config) if isinstance(config, dict) else {}
    if not isinstance(vision, dict):
        return
    wanted = {"hidden_act": options.activation, "layer_norm_eps": options.norm_eps}
    acts = {"quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    got_act = acts.get(str(vision.get("hidden_act")), vision.get("hidden_act"))
    if "hidden_act" in vision and got_act != wanted["hidden_act"]:
        raise ForgeError(
            f"the vision checkpoint {folder} uses the activation '{vision['hidden_act']}', [model.vision] activation "
            f"= '{options.activation}'; set it to '{got_act}'."
        )
    eps = vision.get("layer_norm_eps")
    if isinstance(eps, int | float) and not math.isclose(eps, options.norm_eps, rel_tol=1e-6):
        raise ForgeError(
            f"the vision checkpoint {folder} has layer_norm_eps = {eps}, [model.vision] norm_eps = "
            f"{options.norm_eps}; set norm_eps = {eps}."
        )


def options_from_hf_vision(vision: Mapping[str, Any], feature_layer: int, feature_select: str) -> ViTOptions:
    """:class:`ViTOptions` reproducing a Hugging Face CLIP or SigLIP ``vision_config``."""
    model_type = vision.get("model_type", "clip_vision_model")
    siglip = "siglip" in str(model_type)
    acts = {"quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    act = vision.get("hidden_act", "gelu_pytorch_tanh" if siglip else "quick_gelu")
    if act not in acts:
        raise ForgeError(f"the vision tower's activation '{act}' is not one forge-vlm has ({', '.join(acts)}).")
    return ViTOptions(
        image_size=int(vision.get("image_size", 224)),
        patch_size=int(vision.get("patch_size", 14 if not siglip else 16)),
        channels=int(vision.get("num_channels", 3)),
        width=int(vision["hidden_size"]),
        depth=int(vision["num_hidden_layers"]),
        heads=int(vision["num_attention_heads"]),
        mlp_dim=int(vision["intermediate_size"]),
        norm_eps=float(vision.get("layer_norm_eps", 1e-6 if siglip else 1e-5)),
        activation=acts[act],
        class_token=not siglip,
        patch_bias=siglip,
        pre_norm=not siglip,
        feature_layer=feature_layer,
        feature_select=feature_select,
    )
