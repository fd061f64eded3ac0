"""The DFlash draft's block forward written out for one anchor: the definition its batched forward and its
objective are tested against (tests/draft/test_dflash.py, test_dflash_objective.py)."""

import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb


def per_anchor_block(draft, aux, embeds, anchor, start, positions):
    """The definition for one anchor at column ``anchor`` of a document starting at ``start``: context keys of
    columns ``start .. anchor - 1`` from ``hidden_norm(fc(taps))`` (RoPE at their positions), the block
    ``[embed(x_anchor), mask, ...]`` at positions ``pos(anchor) + s``, plain softmax attention over both."""
    size = draft.config.block_size
    context = draft.hidden_norm(draft.fc(aux[None, start:anchor]))
    mask = draft.embed_input_ids(torch.tensor([draft.config.mask_token_id]))
    hidden = torch.cat([embeds[None, None, anchor], mask.expand(1, size - 1, -1)], dim=1)
    context_cos, context_sin = draft.rotary_emb(context, positions[None, start:anchor])
    block_cos, block_sin = draft.rotary_emb(hidden, positions[anchor] + torch.arange(size)[None])
    for layer in draft.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)

        def heads(proj, y, n, head_dim=attn.head_dim):
            return proj(y).view(1, y.shape[1], n, head_dim).transpose(1, 2)

        q = attn.q_norm(heads(attn.q_proj, x, attn.num_heads))
        k = attn.k_norm(heads(attn.k_proj, x, attn.num_key_value_heads))
        q, k = apply_rotary_pos_emb(q, k, block_cos, block_sin)
        ck = attn.k_norm(heads(attn.k_proj, context, attn.num_key_value_heads))
        _, ck = apply_rotary_pos_emb(ck, ck, context_cos, context_sin)
        keys = torch.cat([ck, k], dim=2)
        values = torch.cat(
            [heads(attn.v_proj, context, attn.num_key_value_heads), heads(attn.v_proj, x, attn.num_key_value_heads)], 2
        )
        group = attn.num_heads // attn.num_key_value_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        probs = torch.softmax(q @ keys.transpose(-1, -2) * attn.head_dim**-0.5, dim=-1)
        out = (probs @ values).transpose(1, 2).reshape(1, x.shape[1], -1)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden[0]
