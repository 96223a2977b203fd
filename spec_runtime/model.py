"""A minimal Llama-family decoder whose attention runs through an ``AttentionBackend``.

RMSNorm, neox-style RoPE (HF ``rotate_half``), GQA attention, SwiGLU MLP, tied or separate LM
head.  Weights are a dict under HF ``LlamaForCausalLM`` names (see ``loader.py``).  A model
over the first ``N`` layers of the same weights (shared, not copied) is the default EAGLE
self-speculative drafter: ``LlamaModel(cfg, weights, num_layers=N)``.

Two forward paths compute the same function:

- :meth:`LlamaModel.forward`: the reference, op by op as HF's ``LlamaForCausalLM`` (about
  40 kernels per layer on a GPU);
- :meth:`LlamaModel.forward_logits` with ``fused=True`` (the default on CUDA): five fused
  ops per layer plus attention (:mod:`specattn.ops.fused_llama`): RMSNorm + QKV projection
  + RoPE + KV-cache store, attention (``save_kv_cache=False``: the KV is already stored),
  o_proj + residual add, RMSNorm + gate/up projection + SiLU-and-multiply, down_proj +
  residual add; then RMSNorm + LM head in one op.  The Q/K/V weights are stacked once into
  ``self_attn.qkv_proj.weight`` (the per-projection entries become views of it), and the
  RMSNorm weights are folded once into the GEMM weights that read the norms
  (``*.folded_weight`` entries: QKV, gate/up, LM head; :func:`specattn.ops.fold_rms_norm_weight`).
  Each residual GEMM also hands the next norm its rows' sums of squares
  (``matmul_residual(..., return_row_sumsq=True)``), so the GEMMs that read a norm run a
  pure loop over the activations as loaded.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from specattn import ops
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


def _stack_qkv(w: Dict[str, torch.Tensor], config: LlamaConfig) -> None:
    """Add ``self_attn.qkv_proj.weight = cat(q, k, v)`` per layer (once per weights dict) and
    make the per-projection entries views of it, so nothing is stored twice."""
    hq = config.num_attention_heads * config.head_dim
    hkv = config.num_key_value_heads * config.head_dim
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        if p + "qkv_proj.weight" in w:
            continue
        qkv = torch.cat([w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"]]).contiguous()
        w[p + "qkv_proj.weight"] = qkv
        w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"] = qkv.split([hq, hkv, hkv])


def _fold_norm_weights(w: Dict[str, torch.Tensor], config: LlamaConfig) -> None:
    """Add the ``*.folded_weight`` entries (once per weights dict): each layer's stacked QKV
    weight times ``input_layernorm``, gate and up times ``post_attention_layernorm``, and the
    LM head times ``model.norm`` (a copy: the embedding it may be tied to stays as is)."""
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        if p + "self_attn.qkv_proj.folded_weight" in w:
            continue
        w[p + "self_attn.qkv_proj.folded_weight"] = ops.fold_rms_norm_weight(
            w[p + "self_attn.qkv_proj.weight"], w[p + "input_layernorm.weight"])
        for proj in ("gate_proj", "up_proj"):
            w[f"{p}mlp.{proj}.folded_weight"] = ops.fold_rms_norm_weight(
                w[f"{p}mlp.{proj}.weight"], w[p + "post_attention_layernorm.weight"])
    if "lm_head.folded_weight" not in w:
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        w["lm_head.folded_weight"] = ops.fold_rms_norm_weight(head, w["model.norm.weight"])


class LlamaModel:
    """Llama decoder over ``num_layers`` (default all) layers of ``weights``.

    Args:
        config: :class:`LlamaConfig`.
        weights: HF-named tensors (moved to ``device``/``dtype`` once; shared with any other
            model built over the same dict).
        num_layers: use only the first ``num_layers`` layers (self-speculative drafter).
        fused: run :meth:`forward_logits` through the fused ops (default: on CUDA).  The
            engine calls :meth:`reserve_positions` with its ``max_context``; positions past
            the RoPE table are not checked on that path.
    """

    def __init__(self, config: LlamaConfig, weights: Dict[str, torch.Tensor], device="cpu",
                 dtype=torch.float32, num_layers: Optional[int] = None, fused: Optional[bool] = None):
        self.config, self.dtype = config, dtype
        self.device = torch.empty(0, device=device).device
        self.num_layers = num_layers or config.num_hidden_layers
        if not 1 <= self.num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers must be in [1, {config.num_hidden_layers}]")
        self.w = place_weights(weights, self.device, dtype)
        c = config
        self.layers = [AttentionLayer.mha(i, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
                       for i in range(self.num_layers)]
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        self.fused = self.device.type == "cuda" if fused is None else bool(fused)
        self.cos_sin_cache: Optional[torch.Tensor] = None
        if self.fused:
            _stack_qkv(self.w, config)
            _fold_norm_weights(self.w, config)
            self.reserve_positions(config.max_position_embeddings)

    def reserve_positions(self, n: int) -> None:
        """Make the fused path's RoPE table cover positions ``0 .. n-1`` (float32
        ``[n, head_dim]``, :func:`specattn.ops.make_cos_sin_cache`)."""
        if self.fused and (self.cos_sin_cache is None or self.cos_sin_cache.shape[0] < n):
            self.cos_sin_cache = ops.make_cos_sin_cache(n, self.config.head_dim, self.config.rope_theta,
                                                        device=self.device)

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

    def forward_logits(self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                       capture_layers: Sequence[int] = (), logit_rows: Optional[torch.Tensor] = None,
                       top_k: Optional[int] = None):
        """float32 logits ``[T, vocab]`` of ``input_ids [T]`` (``[R, vocab]`` of the token rows
        ``logit_rows``, int64 ``[R]``, when given: the final norm and LM head run on those
        rows only) and the residual stream after each layer in ``capture_layers``, side by
        side in layer order: ``[T, n * hidden_size]`` (None when no layer is captured;
        the fused path's residual GEMM of each such layer also writes its columns, no
        concatenation), by the fused ops
        when ``self.fused`` (module docstring), else ``logits(forward(...))``.  With
        ``top_k`` (1-16) on the fused path, the first item is instead ``(values float32 [R, top_k], indices int64 [R, top_k])``, the best
        log-probabilities per row from :func:`specattn.ops.rms_norm_matmul_topk` (the
        logits are never written).  Writes the KV at ``batch.out_cache_loc`` of
        ``backend.kv_pool``; no host sync."""
        if not self.fused:
            hidden, captured = self.forward(input_ids, batch, backend, capture_layers)
            return (self.logits(hidden if logit_rows is None else hidden[logit_rows]),
                    torch.cat(captured, -1) if captured else None)
        c, w = self.config, self.w
        T, eps = input_ids.shape[0], c.rms_norm_eps
        pool = backend.kv_pool
        h = w["model.embed_tokens.weight"][input_ids]
        H = h.shape[1]
        cap = [i for i in range(len(self.layers)) if i in capture_layers]   # (forward's order)
        captured = torch.empty(T, len(cap) * H, dtype=h.dtype, device=h.device) if cap else None
        ss = None  # the rows' sums of squares of h, from the residual GEMM that wrote it
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q = ops.qkv_rope_store(h, None, w[p + "self_attn.qkv_proj.folded_weight"], eps,
                                   batch.positions, self.cos_sin_cache, batch.out_cache_loc,
                                   pool.get_key_buffer(i), pool.get_value_buffer(i), c.num_attention_heads,
                                   c.num_key_value_heads, c.head_dim, row_sumsq=ss, check_values=False,
                                   **dict(zip(("k_scale", "v_scale"), pool.kv_scales(i))))
            o = backend.forward(q, None, None, layer, batch, save_kv_cache=False)
            _, ss = ops.matmul_residual(o.reshape(T, -1), w[p + "self_attn.o_proj.weight"], h,
                                        return_row_sumsq=True)
            act = ops.rms_norm_swiglu(h, None, w[p + "mlp.gate_proj.folded_weight"],
                                      w[p + "mlp.up_proj.folded_weight"], eps, row_sumsq=ss)
            j = cap.index(i) if i in capture_layers else None   # captured: written by the same launch
            _, ss = ops.matmul_residual(act, w[p + "mlp.down_proj.weight"], h, return_row_sumsq=True,
                                        copy_to=None if j is None else captured[:, j * H:(j + 1) * H])
        if logit_rows is not None:
            h, ss = h[logit_rows], None
        if top_k is not None and top_k <= ops.TOPK_MAX_K:
            return ops.rms_norm_matmul_topk(h, None, w["lm_head.folded_weight"], eps, top_k, row_sumsq=ss), captured
        logits = ops.rms_norm_matmul(h, None, w["lm_head.folded_weight"], eps, out_dtype=torch.float32,
                                     row_sumsq=ss)
        return logits, captured

    def make_kv_pool(self, size: int, page_size: int = 1, num_layers: Optional[int] = None,
                     kv_cache_dtype: Optional[torch.dtype] = None, k_scale=1.0, v_scale=1.0):
        """A KV pool fitting this model's attention (``num_layers`` default: the model's), in
        ``kv_cache_dtype`` (default: the model's dtype; ``torch.float8_e4m3fn`` with the
        dequantization scales ``k_scale`` / ``v_scale``, a float or one per layer:
        :class:`~specattn.backends.MHATokenToKVPool`)."""
        from specattn.backends import MHATokenToKVPool
        c = self.config
        return MHATokenToKVPool(size, page_size, kv_cache_dtype or self.dtype, c.num_key_value_heads,
                                c.head_dim, num_layers or self.num_layers, self.device,
                                k_scale=k_scale, v_scale=v_scale)

    def with_layers(self, num_layers: int) -> "LlamaModel":
        """The same model over its first ``num_layers`` layers (weights shared): the default
        EAGLE self-speculative drafter."""
        m = LlamaModel(self.config, self.w, self.device, self.dtype, num_layers=num_layers, fused=self.fused)
        if self.fused:
            m.cos_sin_cache = self.cos_sin_cache
        return m

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, hidden_size]`` -> float32 logits ``[T, vocab_size]``."""
        return (hidden @ self.lm_head.T).float()
