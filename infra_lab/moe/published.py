"""DeepSeek-V3's parameters counted from its configuration: the shape `ModelConfig` cannot hold
(multi-head latent attention, shared experts, dense first layers).

The fields are those of config.json in deepseek-ai/DeepSeek-V3 on Hugging Face. The report
(DeepSeek-AI, DeepSeek-V3 Technical Report, 2024, abstract) gives 671B total parameters with 37B
activated per token; the Hugging Face checkpoint holds 685B, the 671B plus its 14B multi-token
prediction module (its README), which the count leaves out as the report does.
"""
from __future__ import annotations

from typing import NamedTuple

DEEPSEEK_V3 = {  # config.json of deepseek-ai/DeepSeek-V3
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
}


class Count(NamedTuple):
    total: int  # every weight, norms, router and balancing bias included
    active: int  # the weights one token multiplies: the embedding table is only indexed


def mla_attention_params(c: dict) -> int:
    """One layer of multi-head latent attention: queries through a rank-q_lora_rank bottleneck,
    keys and values through a kv_lora_rank latent (plus a shared rotary key), and the output."""
    d, heads = c["hidden_size"], c["num_attention_heads"]
    q_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    queries = d * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * q_head
    latent = d * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
    keys_values = c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
    return queries + latent + keys_values + heads * c["v_head_dim"] * d


def deepseek_v3_params(c: dict = DEEPSEEK_V3) -> Count:
    d, layers = c["hidden_size"], c["num_hidden_layers"]
    dense_layers = c["first_k_dense_replace"]
    moe_layers = layers - dense_layers
    expert = 3 * d * c["moe_intermediate_size"]  # gate, up, down
    routed, shared, k = c["n_routed_experts"], c["n_shared_experts"], c["num_experts_per_tok"]
    router = routed * d + routed  # the gate's weights and its balancing bias (e_score_correction_bias)
    per_layer = mla_attention_params(c) + 2 * d  # two RMSNorms
    dense_mlp = 3 * d * c["intermediate_size"]
    embedding = lm_head = c["vocab_size"] * d
    total = (layers * per_layer + dense_layers * dense_mlp + moe_layers * ((routed + shared) * expert + router)
             + embedding + lm_head + d)
    active = (layers * per_layer + dense_layers * dense_mlp + moe_layers * ((k + shared) * expert + routed * d)
              + lm_head + d)
    return Count(total, active)
