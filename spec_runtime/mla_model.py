"""A minimal DeepSeek-V2-style MLA decoder (absorbed form, random init) whose attention runs
through an ``AttentionBackend`` over an :class:`~specattn.backends.MLATokenToKVPool`.

Per layer: RMSNorm -> MLA attention -> residual -> RMSNorm -> SwiGLU MLP -> residual; then a
final RMSNorm and the LM head (tied to the embeddings or not).  Weights are a dict under HF
``DeepseekV2ForCausalLM`` names, ``[out_features, in_features]``:

==========================================  =============================================
``model.embed_tokens.weight``               ``[V, hidden]``
``...self_attn.q_proj.weight``              ``[H * (nope + rope), hidden]`` (``q_lora_rank`` None)
``...self_attn.q_a_proj.weight``            ``[q_lora_rank, hidden]``        (else, with
``...self_attn.q_a_layernorm.weight``       ``[q_lora_rank]``                 these three)
``...self_attn.q_b_proj.weight``            ``[H * (nope + rope), q_lora_rank]``
``...self_attn.kv_a_proj_with_mqa.weight``  ``[kv_lora_rank + rope, hidden]``: ``W_dkv`` then ``W_kr``
``...self_attn.kv_a_layernorm.weight``      ``[kv_lora_rank]``
``...self_attn.kv_b_proj.weight``           ``[H * (nope + v), kv_lora_rank]``: per head ``W_uk`` then ``W_uv``
``...self_attn.o_proj.weight``              ``[hidden, H * v]``
``...mlp.{gate,up,down}_proj.weight``, ``...{input,post_attention}_layernorm.weight``, ``model.norm.weight``,
``lm_head.weight`` (only when not tied)
==========================================  =============================================

(``nope = qk_nope_head_dim``, ``rope = qk_rope_head_dim``, ``v = v_head_dim``, ``H`` heads.)

MLA attention, absorbed form, for ``x [T, hidden]`` (the normed residual) at ``positions``::

    q              = W_q x                       -> [T, H, nope + rope]; q_nope, q_pe = split
    kv_a           = W_kv_a x                    -> [T, r + rope]       (r = kv_lora_rank)
    c_kv           = RMSNorm(kv_a[:, :r])        -> [T, r]              (the latent)
    k_pe           = RoPE(kv_a[:, r:])           -> [T, rope]           (one key head, shared)
    q_pe           = RoPE(q_pe)                  -> [T, H, rope]
    W_uk[h]        = kv_b[h, :nope, :]           [nope, r];  W_uv[h] = kv_b[h, nope:, :]  [v, r]
    q_absorbed[t,h] = q_nope[t,h] @ W_uk[h]      -> [T, H, r]
    q_full         = cat(q_absorbed, q_pe)       -> [T, H, r + rope]
    latent         = cat(c_kv, k_pe)[:, None]    -> [T, 1, r + rope]    (written to the pool)
    o_latent       = backend.forward(q_full, latent, None, layer)  -> [T, H, r]
                   = softmax_s(scaling * q_full[t,h] . latent[s]) @ latent[s, :r]
    o[t,h]         = o_latent[t,h] @ W_uv[h]^T   -> [T, H, v]
    out            = W_o o.reshape(T, H * v)     -> [T, hidden]

with ``scaling = (nope + rope) ** -0.5``.  This equals non-absorbed MLA, whose per-head keys
are ``k[s,h] = cat(W_uk[h] c_kv[s], k_pe[s])`` and values ``v[s,h] = W_uv[h] c_kv[s]``, since
``q_nope[t,h] . (W_uk[h] c_kv[s]) = (q_nope[t,h] @ W_uk[h]) . c_kv[s]`` and the value
projection commutes with the attention average.  (DeepSeek-V2/V3 add a YaRN ``mscale`` to
``scaling`` for long contexts; not modelled here.)

RoPE is neox style (HF ``rotate_half``, :func:`~specattn.spec_runtime.model.apply_rope`) on
the ``rope`` dims of ``q`` and ``k_pe``.  Real DeepSeek checkpoints use the interleaved
(GPT-J) pairing; a loader would permute the rope rows of ``q_proj``/``q_b_proj`` and
``kv_a_proj_with_mqa`` (pairs ``(2i, 2i+1)`` -> ``(i, i + rope/2)``) to run them here.

:func:`random_mla_weights` gives a deterministic random init with peaked logits and varied
greedy continuations; :class:`MLAModel` provides what :class:`~specattn.spec_runtime.engine.Engine`
needs of a model (``forward``, ``logits``, ``make_kv_pool``, ``with_layers``, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specattn.backends import AttentionBackend, AttentionLayer, ForwardBatch

from .model import place_weights, swiglu_mlp, apply_rope, rms_norm, rope_cos_sin

__all__ = ["MLAConfig", "MLAModel", "random_mla_weights"]


@dataclass
class MLAConfig:
    """Shapes and numeric hyper-parameters of the MLA decoder (names as HF DeepseekV2Config).

    ``q_lora_rank = None`` is a plain ``q_proj``; otherwise ``q`` goes through a low-rank
    ``q_a_proj -> RMSNorm -> q_b_proj``.  ``qk_rope_head_dim`` must be even.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    def __post_init__(self):
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"MLAConfig.{k} must be a positive int, got {v!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"MLAConfig.q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError("rms_norm_eps and rope_theta must be > 0")

    @property
    def qk_head_dim(self) -> int:
        """``qk_nope_head_dim + qk_rope_head_dim`` (the non-absorbed q/k head width)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scaling(self) -> float:
        """Softmax scale ``qk_head_dim ** -0.5`` (applied to the absorbed ``q . latent``)."""
        return self.qk_head_dim ** -0.5

    def param_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Name -> shape of every weight (HF DeepseekV2 names; ``lm_head`` only if untied)."""
        H, D, r = self.num_attention_heads, self.hidden_size, self.kv_lora_rank
        out: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, D)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (D,)
            if self.q_lora_rank is None:
                out[p + "self_attn.q_proj.weight"] = (H * self.qk_head_dim, D)
            else:
                out[p + "self_attn.q_a_proj.weight"] = (self.q_lora_rank, D)
                out[p + "self_attn.q_a_layernorm.weight"] = (self.q_lora_rank,)
                out[p + "self_attn.q_b_proj.weight"] = (H * self.qk_head_dim, self.q_lora_rank)
            out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (r + self.qk_rope_head_dim, D)
            out[p + "self_attn.kv_a_layernorm.weight"] = (r,)
            out[p + "self_attn.kv_b_proj.weight"] = (H * (self.qk_nope_head_dim + self.v_head_dim), r)
            out[p + "self_attn.o_proj.weight"] = (D, H * self.v_head_dim)
            out[p + "post_attention_layernorm.weight"] = (D,)
            out[p + "mlp.gate_proj.weight"] = (self.intermediate_size, D)
            out[p + "mlp.up_proj.weight"] = (self.intermediate_size, D)
            out[p + "mlp.down_proj.weight"] = (D, self.intermediate_size)
        out["model.norm.weight"] = (D,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, D)
        return out


def random_mla_weights(config: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.float32
                       ) -> Dict[str, torch.Tensor]:
    """Deterministic random weights (CPU, ``dtype``) for ``config`` from ``seed``.

    Init (as :func:`~specattn.spec_runtime.loader.write_random_hf_dir`): embeddings and
    ``lm_head`` ~ N(0, 1), other linears ~ N(0, 4 / in_features), norm weights ~
    1 + 0.1 N(0, 1).  Gives peaked logits (std ~ sqrt(hidden)) and varied greedy continuations.
    """
    from .loader import random_weights
    return random_weights(config.param_shapes(), seed, dtype)


class MLAModel:
    """The MLA decoder over its first ``num_layers`` (default all) layers of ``weights``.

    Args:
        config: :class:`MLAConfig`.
        weights: tensors named as in the module docstring (moved to ``device``/``dtype`` in
            place, once; shared with every model built over the same dict).  Default:
            ``random_mla_weights(config, seed)``.
        device, dtype: where and in what the model runs (``device`` is resolved, e.g.
            ``"cuda"`` -> ``cuda:0``).
        num_layers: use only the first ``num_layers`` layers (the EAGLE self-spec drafter).
        seed: for the default random weights.

    Raises:
        ValueError: ``num_layers`` outside ``[1, num_hidden_layers]`` or a weight missing or
            of the wrong shape.
    """

    def __init__(self, config: MLAConfig, weights: Optional[Dict[str, torch.Tensor]] = None,
                 device="cpu", dtype: torch.dtype = torch.float32, num_layers: Optional[int] = None,
                 seed: int = 0):
        self.config, self.dtype = config, dtype
        self.device = torch.empty(0, device=device).device
        self.num_layers = num_layers or config.num_hidden_layers
        if not 1 <= self.num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers must be in [1, {config.num_hidden_layers}], got {num_layers}")
        if weights is None:
            weights = random_mla_weights(config, seed)
        for name, shape in config.param_shapes().items():
            if name not in weights or tuple(weights[name].shape) != shape:
                got = tuple(weights[name].shape) if name in weights else "missing"
                raise ValueError(f"weight {name}: expected {shape}, got {got}")
        self.w = place_weights(weights, self.device, dtype)
        c = config
        self.layers = [AttentionLayer.mla(i, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim,
                                          scaling=c.scaling) for i in range(self.num_layers)]
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        # per-layer views of kv_b_proj: W_uk [H, nope, r], W_uv [H, v, r] (no copies)
        H, nope, v = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        self._w_uk, self._w_uv = [], []
        for i in range(self.num_layers):
            kv_b = weights[f"model.layers.{i}.self_attn.kv_b_proj.weight"].view(H, nope + v, c.kv_lora_rank)
            self._w_uk.append(kv_b[:, :nope])
            self._w_uv.append(kv_b[:, nope:])

    # ------------------------------------------------------------------ attention
    def _q(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """``x [T, hidden]`` -> ``q [T, H, nope + rope]``."""
        c, w = self.config, self.w
        if c.q_lora_rank is None:
            q = x @ w[p + "self_attn.q_proj.weight"].T
        else:
            qa = rms_norm(x @ w[p + "self_attn.q_a_proj.weight"].T, w[p + "self_attn.q_a_layernorm.weight"],
                          c.rms_norm_eps)
            q = qa @ w[p + "self_attn.q_b_proj.weight"].T
        return q.view(x.shape[0], c.num_attention_heads, c.qk_head_dim)

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Absorbed MLA of layer ``i`` (module docstring) for ``x [T, hidden]`` -> ``[T, hidden]``;
        ``cos``/``sin [T, rope]`` at ``batch.positions``.  Writes the latent ``[T, 1, r + rope]``
        at ``batch.out_cache_loc`` through ``backend``."""
        c, w, p = self.config, self.w, f"model.layers.{i}."
        T, r, nope = x.shape[0], c.kv_lora_rank, c.qk_nope_head_dim
        q = self._q(x, p)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv_a = x @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T                     # [T, r + rope]
        c_kv = rms_norm(kv_a[:, :r], w[p + "self_attn.kv_a_layernorm.weight"], c.rms_norm_eps)
        k_pe = apply_rope(kv_a[:, None, r:], cos, sin)                                 # [T, 1, rope]
        q_pe = apply_rope(q_pe, cos, sin)                                              # [T, H, rope]
        q_abs = torch.bmm(q_nope.transpose(0, 1), self._w_uk[i]).transpose(0, 1)      # [T, H, r]
        q_full = torch.cat([q_abs, q_pe], dim=-1)                                      # [T, H, r + rope]
        latent = torch.cat([c_kv[:, None, :], k_pe], dim=-1)                           # [T, 1, r + rope]
        o_lat = backend.forward(q_full, latent, None, self.layers[i], batch)          # [T, H, r]
        o = torch.bmm(o_lat.transpose(0, 1), self._w_uv[i].transpose(1, 2))           # [H, T, v]
        return o.transpose(0, 1).reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T

    # ------------------------------------------------------------------ the engine's interface
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                capture_layers: Sequence[int] = ()) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Run ``input_ids [T]`` (int64) for ``batch`` (metadata already initialised on
        ``backend``); the latents are written at ``batch.out_cache_loc``.  No host syncs
        (CUDA-graph capturable).

        Returns:
            ``(hidden [T, hidden_size] in dtype after the final norm, [residual stream
            [T, hidden_size] after each layer in capture_layers])``.
        """
        c, w = self.config, self.w
        h = w["model.embed_tokens.weight"][input_ids]
        cos, sin = rope_cos_sin(batch.positions, c.qk_rope_head_dim, c.rope_theta, self.dtype)
        captured = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            h = h + self.attention(i, x, cos, sin, batch, backend)
            h = h + swiglu_mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps), w, p)
            if i in capture_layers:
                captured.append(h)
        return rms_norm(h, w["model.norm.weight"], c.rms_norm_eps), captured

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, hidden_size]`` -> float32 logits ``[T, vocab_size]``."""
        return (hidden @ self.lm_head.T).float()

    def make_kv_pool(self, size: int, page_size: int = 1, num_layers: Optional[int] = None,
                     kv_cache_dtype: Optional[torch.dtype] = None, k_scale=1.0, v_scale=None):
        """An :class:`~specattn.backends.MLATokenToKVPool` for this model: per layer a latent
        ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`` in ``kv_cache_dtype``
        (default: the model's dtype; ``torch.float8_e4m3fn`` with the latent's scale
        ``k_scale``, a float or one per layer; ``v_scale`` must be None or equal it: the values
        are the latent)."""
        from specattn.backends import MLATokenToKVPool
        if v_scale is not None and v_scale != k_scale:
            raise ValueError("an MLA latent has one scale: pass v_scale=None or equal to k_scale")
        c = self.config
        return MLATokenToKVPool(size, page_size, kv_cache_dtype or self.dtype, num_layers or self.num_layers,
                                self.device, kv_lora_rank=c.kv_lora_rank,
                                qk_rope_head_dim=c.qk_rope_head_dim, kv_scale=k_scale)

    def with_layers(self, num_layers: int) -> "MLAModel":
        """The same model over its first ``num_layers`` layers (weights shared, not copied):
        the default EAGLE self-speculative drafter."""
        return MLAModel(self.config, self.w, self.device, self.dtype, num_layers=num_layers)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]
