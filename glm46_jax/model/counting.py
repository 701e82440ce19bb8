"""Parameter counts from the config alone, checked against instantiated models in tests.

The GLM-4.5 report counts "trunk + MTP, without word embeddings and output layer": that
convention gives exactly 355.23B total / 32.48B active for GLM-4.5 (docs/architecture.md#parameter-counting).
"""

from __future__ import annotations

import dataclasses

from glm46_jax.config import ModelConfig


def attention_params(c: ModelConfig) -> int:
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    n = c.hidden_size * q_out + 2 * c.hidden_size * kv_out + q_out * c.hidden_size
    if c.attention_bias:
        n += q_out + 2 * kv_out
    if c.use_qk_norm:
        n += 2 * c.head_dim
    return n


def expert_params(c: ModelConfig) -> int:
    return 3 * c.hidden_size * c.moe_intermediate_size


def dense_layer_params(c: ModelConfig) -> int:
    return attention_params(c) + 2 * c.hidden_size + 3 * c.hidden_size * c.intermediate_size


def moe_layer_params(c: ModelConfig, active: bool = False) -> int:
    experts = (c.num_experts_per_tok if active else c.n_routed_experts) + c.n_shared_experts
    router = c.n_routed_experts * c.hidden_size + c.n_routed_experts  # weight + correction bias
    return attention_params(c) + 2 * c.hidden_size + experts * expert_params(c) + router


def mtp_layer_params(c: ModelConfig, active: bool = False) -> int:
    """One MoE decoder layer + enorm, hnorm, eh_proj, shared_head.norm (embedding and head are shared)."""
    h = c.hidden_size
    return moe_layer_params(c, active) + 2 * h + 2 * h * h + h


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    trunk_total: int  # decoder layers + final norm
    trunk_active: int
    mtp_total: int
    mtp_active: int
    embedding: int
    lm_head: int

    @property
    def report_total(self) -> int:
        """The GLM-4.5 report's convention: trunk + MTP, no embedding / head."""
        return self.trunk_total + self.mtp_total

    @property
    def report_active(self) -> int:
        return self.trunk_active + self.mtp_active

    @property
    def model_total(self) -> int:
        """Every parameter this project's model holds (trunk, MTP, embedding, head)."""
        return self.trunk_total + self.mtp_total + self.embedding + self.lm_head


def param_counts(c: ModelConfig) -> ParamCounts:
    def trunk(active: bool) -> int:
        return (c.num_dense_layers * dense_layer_params(c)
                + c.num_moe_layers * moe_layer_params(c, active) + c.hidden_size)

    n_mtp = c.num_nextn_predict_layers
    return ParamCounts(
        trunk_total=trunk(False), trunk_active=trunk(True),
        mtp_total=n_mtp * mtp_layer_params(c), mtp_active=n_mtp * mtp_layer_params(c, True),
        embedding=c.vocab_size * c.hidden_size, lm_head=c.vocab_size * c.hidden_size)


def matmul_params_per_token(c: ModelConfig) -> int:
    """Weights each token multiplies in one forward pass (the N of "6 N" training FLOPs).

    Counted: attention q/k/v/o projections, the dense FFNs, the router, the k routed + shared
    experts of every MoE layer, the MTP layer (eh_proj + its MoE block) and the output head
    once for the main logits and once more for the MTP logits (the MTP layer shares the head).
    Not counted: the embedding lookup (a gather), norms, biases, the correction bias.
    """
    h = c.hidden_size
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = 2 * h * q_out + 2 * h * kv_out
    dense = attn + 3 * h * c.intermediate_size
    moe = attn + (c.num_experts_per_tok + c.n_shared_experts) * expert_params(c) + c.n_routed_experts * h
    mtp = c.num_nextn_predict_layers * (moe + 2 * h * h)
    head = (1 + c.num_nextn_predict_layers) * c.vocab_size * h
    return c.num_dense_layers * dense + c.num_moe_layers * moe + mtp + head


def flops_per_token(c: ModelConfig, seq_len: int) -> int:
    """Model FLOPs per trained token (forward + backward), the MFU numerator.

    6 x `matmul_params_per_token` (2 per multiply-add forward, 4 backward), plus causal attention:
    QK^T and PV cost 2 * 2 * seq_len * nh * hd forward per token and layer at full length; causal
    masking halves that on average; x3 for the backward. That is 6 * seq_len * nh * hd per layer,
    over the num_hidden_layers + MTP layers. Remat recompute is not counted (model FLOPs, not hardware FLOPs).
    """
    attn_layers = c.num_hidden_layers + c.num_nextn_predict_layers
    attention = 6 * attn_layers * seq_len * c.num_attention_heads * c.head_dim
    return 6 * matmul_params_per_token(c) + attention
