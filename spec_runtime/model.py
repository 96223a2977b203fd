"""A minimal Llama-family decoder whose attention runs through an ``AttentionBackend``.

RMSNorm, neox-style RoPE (HF ``rotate_half``), GQA attention, SwiGLU MLP, tied or separate LM
head.  Weights are a dict under HF ``LlamaForCausalLM`` names (see ``loader.py``).  A model
over the first ``N`` layers of the same weights (shared, not copied) is the default EAGLE
self-speculative drafter: ``LlamaModel(cfg, weights, num_layers=N)``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from specattn.backends import AttentionBackend, AttentionLayer, ForwardBatch

from .loader import LlamaConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, returned in ``x.dtype`` (as HF Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, head_dim]`` for neox-style RoPE at int64 ``positions [T]``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` rotated by halves (HF ``rotate_half``)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def swiglu_mlp(x: torch.Tensor, w: Dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with the HF weights ``{prefix}mlp.{gate,up,down}_proj``."""
    g = F.silu(x @ w[prefix + "mlp.gate_proj.weight"].T) * (x @ w[prefix + "mlp.up_proj.weight"].T)
    return g @ w[prefix + "mlp.down_proj.weight"].T


def place_weights(weights: Dict[str, torch.Tensor], device: torch.device, dtype) -> Dict[str, torch.Tensor]:
    """Move every tensor of ``weights`` to ``device``/``dtype`` in place (the dict is shared by
    the models built over it, e.g. a drafter over the target's first layers) and return it."""
    for name, t in list(weights.items()):
        if t.device != device or t.dtype != dtype:
            weights[name] = t.to(device, dtype)
    return weights


class LlamaModel:
    """Llama decoder over ``num_layers`` (default all) layers of ``weights``.

    Args:
        config: :class:`LlamaConfig`.
        weights: HF-named tensors (moved to ``device``/``dtype`` once; shared with any other
            model built over the same dict).
        num_layers: use only the first ``num_layers`` layers (self-speculative drafter).
    """

    def __init__(self, config: LlamaConfig, weights: Dict[str, torch.Tensor], device="cpu",
                 dtype=torch.float32, num_layers: Optional[int] = None):
        self.config, self.dtype = config, dtype
        self.device = torch.empty(0, device=device).device
        self.num_layers = num_layers or config.num_hidden_layers
        if not 1 <= self.num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers must be in [1, {config.num_hidden_layers}]")
        self.w = place_weights(weights, self.device, dtype)
        c = config
        self.layers = [AttentionLayer.mha(i, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
                       for i in range(self.num_layers)]
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                capture_layers: Sequence[int] = ()) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Run ``input_ids [T]`` (int64) for ``batch``; KV is written at ``batch.out_cache_loc``.

        Returns:
            ``(hidden [T, hidden_size] after the final norm, [residual stream after each layer
            in capture_layers])`` (the captured states feed DFlash drafters).
        """
        c, w = self.config, self.w
        T = input_ids.shape[0]
        h = w["model.embed_tokens.weight"][input_ids]
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, self.dtype)
        captured = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, c.num_attention_heads, c.head_dim)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, c.num_key_value_heads, c.head_dim)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, c.num_key_value_heads, c.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = backend.forward(q, k, v, layer, batch)
            h = h + o.reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = h + swiglu_mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps), w, p)
            if i in capture_layers:
                captured.append(h)
        return rms_norm(h, w["model.norm.weight"], c.rms_norm_eps), captured

    def make_kv_pool(self, size: int, page_size: int = 1, num_layers: Optional[int] = None):
        """A KV pool fitting this model's attention (``num_layers`` default: the model's)."""
        from specattn.backends import MHATokenToKVPool
        c = self.config
        return MHATokenToKVPool(size, page_size, self.dtype, c.num_key_value_heads, c.head_dim,
                                num_layers or self.num_layers, self.device)

    def with_layers(self, num_layers: int) -> "LlamaModel":
        """The same model over its first ``num_layers`` layers (weights shared): the default
        EAGLE self-speculative drafter."""
        return LlamaModel(self.config, self.w, self.device, self.dtype, num_layers=num_layers)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, hidden_size]`` -> float32 logits ``[T, vocab_size]``."""
        return (hidden @ self.lm_head.T).float()
