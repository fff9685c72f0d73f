"""The lean drafting path of an EAGLE-3 head: its weights and cache held for one rollout, no module calls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...engine.kv_cache import GrowingLayer, RaggedKVModel
from .model import Eagle3Model


class _LeanHead:
    """An `Eagle3Model`'s weights laid out for inference in few operations, for the drafting hot path.

    - Each RMS norm's weight is folded into the matmul after it, so a norm is one unweighted `F.rms_norm`; the
      embedding and hidden-state norms run as one, on the two stacked.
    - q and k, their `rotate_half` (a fixed signed permutation of each head's outputs, folded into the weight) and v
      come from one matmul, so RoPE is two multiplies and an add; gate and up are one matmul.
    - RoPE's cos and sin are computed from the rotary embedding's fixed frequencies (its own forward for the
      dynamic kinds, whose frequencies change with length).

    Equal to the module's forward up to rounding (tested). Built from the current weights: the drafter rebuilds it
    when a weight changes (`version`; online training updates weights in place).
    """

    def __init__(self, model: Eagle3Model):
        layer = model.midlayer
        attn, mlp, d = layer.self_attn, layer.mlp, layer.head_dim
        self.model, self.layer, self.head_dim, self.num_heads = model, layer, d, layer.num_heads
        self.eps = layer.input_layernorm.variance_epsilon

        def rotated(weight):  # rows giving rotate_half of each head's outputs
            weight = weight.view(-1, d, weight.size(-1))
            return torch.cat([-weight[:, d // 2 :], weight[:, : d // 2]], dim=1).flatten(0, 1)

        qk = torch.cat([attn.q_proj.weight, attn.k_proj.weight])
        qkv = torch.cat([qk, rotated(attn.q_proj.weight), rotated(attn.k_proj.weight), attn.v_proj.weight])
        self.qkv_weight = qkv * torch.cat([layer.input_layernorm.weight, layer.hidden_norm.weight])
        self.qkv_sizes = (qk.size(0), qk.size(0), attn.v_proj.out_features)
        post = layer.post_attention_layernorm.weight
        self.gate_up_weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) * post
        self.gate_up_bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
        self.lm_head_weight = model.lm_head.weight * model.norm.weight
        rotary = model.rotary_emb
        self.inv_freq = None if "dynamic" in rotary.rope_type or "longrope" in rotary.rope_type else rotary.inv_freq

    @staticmethod
    def version(model: Eagle3Model) -> tuple:
        """Changes whenever a weight is replaced or updated in place."""
        return tuple((p.data_ptr(), p._version) for p in model.parameters())

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, n, d) at `positions` (B, n), as the head's rotary embedding gives them, in `like`'s dtype."""
        rotary = self.model.rotary_emb
        if self.inv_freq is None:
            return rotary(like, positions)
        freqs = positions[..., None].float() * self.inv_freq.float()
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if rotary.attention_scaling != 1.0:
            cos, sin = cos * rotary.attention_scaling, sin * rotary.attention_scaling
        return cos.to(like.dtype), sin.to(like.dtype)

    def qkv(self, input_ids, hidden, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, heads, n, d) and k, v (B, kv_heads, n, d) of n positions, RoPE applied with cos, sin (B, n or 1, 1, d)."""
        embeds = F.embedding(input_ids, self.model.embedding_weight).to(hidden.dtype)
        x = F.rms_norm(torch.stack([embeds, hidden], dim=-2), (hidden.size(-1),), eps=self.eps).flatten(-2)
        straight, half, v = F.linear(x, self.qkv_weight).split(self.qkv_sizes, dim=-1)
        shape = (*x.shape[:-1], -1, self.head_dim)
        qk = (straight.view(shape) * cos + half.view(shape) * sin).transpose(1, 2)
        q, k = qk.split([self.num_heads, qk.size(1) - self.num_heads], dim=1)
        return q, k, v.view(shape).transpose(1, 2)

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`Eagle3Layer.finish`: output projection, residuals and MLP, the pre-norm output (B, n, H)."""
        layer = self.layer
        hidden = hidden + F.linear(attn_out.transpose(1, 2).flatten(2), layer.self_attn.o_proj.weight)
        normed = F.rms_norm(hidden, (hidden.size(-1),), eps=layer.post_attention_layernorm.variance_epsilon)
        gate, up = F.linear(normed, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        down = layer.mlp.down_proj
        return hidden + F.linear(layer.mlp.act_fn(gate) * up, down.weight, down.bias)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Policy-vocabulary logits of pre-norm outputs."""
        normed = F.rms_norm(prenorm, (prenorm.size(-1),), eps=self.model.norm.variance_epsilon)
        return self.model.to_policy_vocab(F.linear(normed, self.lm_head_weight))


class _DraftSession:
    """The drafter's forwards over draft positions during one `propose`: the committed cache is read, never written.

    The hot path of drafting, kept lean (`_LeanHead`): the draft positions' keys and values are written into the
    free room of the drafter's cache (`GrowingLayer.reserve`; uncommitted, the next commit overwrites them), so each
    draft step is one fused attention over a slice of it (holes masked by a bias built once); RoPE for every draft
    depth is computed once. Equal to `Eagle3Model.forward` on the same inputs up to rounding (tested).
    """

    def __init__(self, head: _LeanHead, runner: RaggedKVModel, depth: int, width: int = 1):
        """`depth` draft steps of `width` positions per row at most."""
        self.head = head
        cache: GrowingLayer = runner.cache.layers[0]  # `RaggedKVModel` builds its caches of `GrowingLayer`s
        committed = cache.get_seq_length()
        room = max(depth, 1) * width
        self.keys, self.values = cache.reserve(room)  # the draft positions go in the cache's free room, uncommitted
        batch = self.keys.size(0)
        self.bias = self.keys.new_zeros((batch, 1, 1, committed + room))  # holes of the cache -inf, drafts 0
        self.bias[:, 0, 0, :committed].masked_fill_(~runner.attention_mask, float("-inf"))
        self.committed = self.filled = committed
        positions = runner.lengths[:, None] + torch.arange(max(depth, 1), device=self.keys.device)[None]
        cos, sin = head.rope(self.keys, positions)  # (B, depth, d): depth j's at index j - 1
        self.cos, self.sin = cos[:, :, None], sin[:, :, None]

    @staticmethod
    def commit(head: _LeanHead, runner: RaggedKVModel, input_ids, hidden, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """Append n positions per row to the committed cache (tokens (B, n), hidden states (B, n, H), `valid` (B, n)
        marks real ones, left-aligned), as `runner.extend` does with `Eagle3Model.forward`, with fewer operations.
        Returns the policy-vocabulary logits (B, V) and pre-norm output (B, H) of each row's last valid position."""
        positions = (runner.lengths[:, None] + valid.long().cumsum(dim=1) - 1).clamp(min=0)
        cos, sin = head.rope(hidden, positions)
        q, k, v = head.qkv(input_ids, hidden, cos[:, :, None], sin[:, :, None])
        keys, values = runner.cache.update(k, v, 0)
        older = runner.attention_mask
        batch, n = valid.shape
        runner.attention_mask = torch.cat([older, valid], dim=1)
        runner.lengths = runner.lengths + valid.sum(dim=1)
        eye = torch.eye(n, dtype=torch.bool, device=valid.device)
        causal = torch.ones((n, n), dtype=torch.bool, device=valid.device).tril() & valid[:, None, :] | eye
        allowed = torch.cat([older[:, None, :].expand(batch, n, -1), causal], dim=2)[:, None]  # (B, 1, n, T)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=True)
        last = (n - 1 - valid.flip(1).int().argmax(1))[:, None, None]  # last valid index per row
        out = out.gather(2, last[:, None].expand(-1, out.size(1), 1, out.size(-1)))
        prenorm = head.finish(out, hidden.gather(1, last.expand(-1, 1, hidden.size(-1)))).squeeze(1)
        return head.logits(prenorm), prenorm

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, depth: int, visible: torch.Tensor | None = None):
        """Feed w draft positions per row at `depth` (1 = the root's children): tokens (B, w), the hidden states they
        pair with (B, w, H), `visible` (B, w, m) over the draft positions fed (these last; None = all, a chain).
        Returns policy-vocabulary logits (B, w, V) and the pre-norm outputs (B, w, H)."""
        head = self.head
        q, k, v = head.qkv(input_ids, hidden, self.cos[:, depth - 1 : depth], self.sin[:, depth - 1 : depth])
        start, end = self.filled, self.filled + input_ids.size(1)
        self.keys[:, :, start:end], self.values[:, :, start:end] = k, v
        self.filled = end
        mask = self.bias[..., :end]
        if visible is not None:  # a tree: each position sees the cache and, of the draft positions, its ancestors
            local = torch.zeros(visible.shape, dtype=mask.dtype, device=mask.device)
            local = local.masked_fill(~visible, float("-inf"))[:, None]
            mask = torch.cat([mask[..., : self.committed].expand(-1, -1, visible.size(1), -1), local], dim=-1)
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        prenorm = head.finish(out, hidden)
        return head.logits(prenorm), prenorm
