"""What a backend needs to know about one attention layer."""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass
from typing import Optional


class AttentionKind(enum.Enum):
    """``MHA`` covers MHA/GQA/MQA (``num_kv_heads`` divides ``num_heads``); ``MLA`` is
    DeepSeek's multi-head latent attention in absorbed form: one shared latent "KV head" of
    width ``kv_lora_rank + qk_rope_head_dim`` (576) for keys, whose first ``kv_lora_rank``
    (512) entries are also the values."""

    MHA = "mha"
    MLA = "mla"


def _scaling(scaling: Optional[float], default: float) -> float:
    """``scaling``, or ``default`` when None; ValueError unless finite and > 0."""
    out = default if scaling is None else scaling
    if isinstance(out, bool) or not (isinstance(out, numbers.Real) and math.isfinite(out) and out > 0):
        raise ValueError(f"scaling must be a finite number > 0, got {scaling!r}")
    return float(out)


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
        """An MHA/GQA layer.  Raises ValueError if ``num_kv_heads`` does not divide
        ``num_heads``, a dim is < 1 (``v_head_dim`` None: ``head_dim``), or the scaling is not
        finite and > 0."""
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, d in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
            if d < 1:
                raise ValueError(f"{name} must be >= 1, got {d}")
        return cls(layer_id, AttentionKind.MHA, num_heads, num_kv_heads, head_dim,
                   v_head_dim, _scaling(scaling, head_dim ** -0.5))

    @classmethod
    def mla(cls, layer_id: int, num_heads: int, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
            scaling: Optional[float] = None) -> "AttentionLayer":
        """An absorbed-MLA layer (``head_dim = kv_lora_rank + qk_rope_head_dim``).  Raises
        ValueError for ``num_heads`` or ``kv_lora_rank`` < 1, ``qk_rope_head_dim`` < 0, or a
        scaling that is not finite and > 0."""
        if num_heads < 1 or kv_lora_rank < 1 or qk_rope_head_dim < 0:
            raise ValueError(f"num_heads and kv_lora_rank must be >= 1 and qk_rope_head_dim >= 0, got "
                             f"{num_heads}, {kv_lora_rank}, {qk_rope_head_dim}")
        d = kv_lora_rank + qk_rope_head_dim
        return cls(layer_id, AttentionKind.MLA, num_heads, 1, d, kv_lora_rank,
                   _scaling(scaling, 1.0 / math.sqrt(d)), kv_lora_rank, qk_rope_head_dim)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads
