"""What a backend needs to know about one attention layer."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional


class AttentionKind(enum.Enum):
    """``MHA`` covers MHA/GQA/MQA (``num_kv_heads`` divides ``num_heads``); ``MLA`` is
    DeepSeek's multi-head latent attention in absorbed form: one shared latent "KV head" of
    width ``kv_lora_rank + qk_rope_head_dim`` (576) for keys, whose first ``kv_lora_rank``
    (512) entries are also the values."""

    MHA = "mha"
    MLA = "mla"


@dataclass(frozen=True)
class AttentionLayer:
    """Static description of one attention layer, passed to ``AttentionBackend.forward``.

    Shapes of ``forward(q, k, v, ...)`` for ``T`` tokens:

    - MHA: ``q [T, num_heads, head_dim]``, ``k [T, num_kv_heads, head_dim]``,
      ``v [T, num_kv_heads, v_head_dim]``, output ``[T, num_heads, v_head_dim]``.
    - MLA: ``q [T, num_heads, kv_lora_rank + qk_rope_head_dim]``, ``k`` the new latent
      ``[T, 1, kv_lora_rank + qk_rope_head_dim]``, ``v`` ignored (may be None), output
      ``[T, num_heads, kv_lora_rank]``.

    ``scaling`` multiplies ``q . k`` before the softmax (default ``head_dim ** -0.5``; MLA
    models pass their own, e.g. ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
    """

    layer_id: int
    kind: AttentionKind
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float
    kv_lora_rank: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None

    @classmethod
    def mha(cls, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
            v_head_dim: Optional[int] = None, scaling: Optional[float] = None) -> "AttentionLayer":
        """An MHA/GQA layer.  Raises ValueError if ``num_kv_heads`` does not divide ``num_heads``."""
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        return cls(layer_id, AttentionKind.MHA, num_heads, num_kv_heads, head_dim,
                   v_head_dim or head_dim, scaling if scaling is not None else head_dim ** -0.5)

    @classmethod
    def mla(cls, layer_id: int, num_heads: int, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
            scaling: Optional[float] = None) -> "AttentionLayer":
        """An absorbed-MLA layer (``head_dim = kv_lora_rank + qk_rope_head_dim``)."""
        d = kv_lora_rank + qk_rope_head_dim
        return cls(layer_id, AttentionKind.MLA, num_heads, 1, d, kv_lora_rank,
                   scaling if scaling is not None else 1.0 / math.sqrt(d),
                   kv_lora_rank, qk_rope_head_dim)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads
