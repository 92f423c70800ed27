"""Built-in model transforms, each in its slot of forge_lm.distributed.TRANSFORM_ORDER."""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_model_transforms(register):
    register(
        "tensor_parallel",
        "forge_lm.distributed.tensor_parallel:tensor_parallel_transform",
        description="tensor + sequence parallelism of attention and feed-forward layers ([distributed] tp > 1)",
    )
    register(
        "activation_checkpointing",
        "forge_lm.distributed.activation_checkpointing:activation_checkpointing_transform",
        description="recompute block activations in backward ([train] activation_checkpointing)",
    )
    register(
        "fsdp2",
        "forge_lm.distributed.fsdp:fsdp2_transform",
        description="FSDP2 fully_shard per block over the data-parallel mesh; HSDP with dp_replicate > 1",
    )
    register(
        "compile",
        "forge_lm.distributed.compile:compile_transform",
        description="torch.compile each transformer block ([train] compile)",
    )
