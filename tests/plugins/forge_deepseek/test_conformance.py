"""forge-deepseek passes the conformance kit a third-party plugin runs on itself: the ``mla``
attention and ``deepseek_v3`` family against their contracts, and the packaging checks."""

from __future__ import annotations

from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import parametrize_with_checks

MANAGER = PluginManager(PluginSettings(allow=("moe", "deepseek")))
# With an MTP module: the kit trains through a collector, so the MTP loss and its gradients are
# part of what it checks (test_mtp.py checks the loss itself against a reference).
TINY_FAMILY = {
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "max_seq_len": 64,
    "n_dense_layers": 1,
    "mtp_depth": 1,
    "attention": {"name": "mla", "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4},
    "ffn": {
        "name": "moe",
        "n_experts": 4,
        "top_k": 2,
        "n_shared_experts": 1,
        "router": {"name": "sigmoid_topk"},
        "expert_kernel": "loop",
    },
}


@parametrize_with_checks(
    components=[
        ("attentions", "mla"),
        ("attentions", "mla", {"options": {"q_lora_rank": 12, "kv_lora_rank": 7, "v_head_dim": 6}}),
        ("models", "deepseek_v3", {"options": TINY_FAMILY}),
    ],
    distributions=["forge-deepseek"],
    manager=MANAGER,
)
def test_forge_deepseek_honours_the_contracts(check):
    check()


def test_forge_deepseek_is_listed_as_an_ok_plugin():
    plugin = PluginManager().plugin("deepseek")
    assert (plugin.distribution, plugin.status) == ("forge-deepseek", "ok")
