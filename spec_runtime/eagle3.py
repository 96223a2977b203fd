"""An EAGLE-3 drafter over a Llama target: one decoder layer fed by fused target features.

What EAGLE-3 is (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test", arXiv 2503.01840; the layout and semantics below are those
of SGLang's ``LlamaForCausalLMEagle3``, vLLM's ``Eagle3LlamaForCausalLM`` and the SpecForge
trainer, described from their documented behaviour, no code taken from any of them)
------------------------------------------------------------------------------------------
- **Target features.**  The residual stream of the target at the *output* of three layers
  (low / middle / high; :func:`default_aux_layer_ids`: ``[1, L//2 - 1, L - 4]`` for ``L``
  layers, which is what both engines capture when the checkpoint names none), before the
  final norm, concatenated in that order: ``g_t`` of width ``3H`` per position ``t``.
- **One drafter entry** reads a token embedding ``e`` (the target's own, frozen table) and a
  hidden ``h``: ``h = fc(g)`` when ``h`` has width ``3H`` (target features), or the
  drafter's previous *pre-norm* output when it has width ``H`` (a later draft step; no
  ``fc``).  Then, with ``residual = h``::

      x  = cat([input_layernorm(e), hidden_norm(h)], -1)          # [T, 2H]
      a  = o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))     # neox RoPE, GQA
      h2 = residual + a
      h3 = h2 + mlp(post_attention_layernorm(h2))                 # SwiGLU
      prenorm = h3;   logits = lm_head(norm(h3))                  # target's LM head, float32

  ``prenorm`` is the hidden of the next draft step; ``logits`` cover the target's full
  vocabulary (no reduced draft vocabulary, so no ``d2t``/``t2d`` maps).
- **Pairing and positions.**  Entry ``t`` pairs the embedding of token ``x_{t+1}`` with the
  target feature ``g_t`` and uses RoPE position ``t``; its logits predict ``x_{t+2}``, i.e.
  its teacher is the target's distribution at position ``t+1``.  A draft step ``k >= 1`` of
  the chain that starts at entry ``t`` reads the draft token ``x_{t+1+k}`` and the entry's
  step ``k-1`` prenorm output, at RoPE position ``t + k``, and attends to the step-0 keys of
  entries ``0..t`` plus its own chain's keys of steps ``1..k``.
- **Training-time test** (:meth:`Eagle3Drafter.dense_forward`) unrolls exactly that chain for
  every entry of a sequence at once, so training sees the drafter's own hidden states as it
  will at inference; the equivalence with the cache-based forward is tested.

Checkpoint (:meth:`Eagle3Drafter.save`): ``config.json`` (HF-style, architectures
``["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, no ``draft_vocab_size``, our own
fields under ``"specattn"``) and ``model.safetensors`` in bf16 with exactly
:meth:`Eagle3Config.param_shapes`'s names: ``fc.weight``, ``midlayer.*``, ``norm.weight``.
SGLang, with ``draft_vocab_size`` unset, takes the embedding and LM head from the target;
vLLM shares both when the checkpoint has none.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from specattn import ops
from specattn.backends import AttentionBackend, AttentionLayer, ForwardBatch

from .loader import LlamaConfig, check_decoder_shape, check_weight_shapes
from .drafter_base import (DEFAULT_DRAFT_VOCAB, TOKEN_FREQUENCIES_FILE, TargetSharingDrafter, default_draft_vocab_size,
                           frequent_tokens, random_init, read_token_counts)
from .model import apply_rope, rms_norm, rope_cos_sin

__all__ = ["ARCHITECTURE", "default_aux_layer_ids", "Eagle3Config", "Eagle3Drafter", "init_weights",
           "checkpoint_nbytes", "frequent_tokens", "read_token_counts", "TOKEN_FREQUENCIES_FILE",
           "DEFAULT_DRAFT_VOCAB", "default_draft_vocab_size"]

ARCHITECTURE = "LlamaForCausalLMEagle3"
#: architecture names other EAGLE-3 Llama checkpoints use (accepted by :meth:`Eagle3Config.from_hf_dict`)
_ACCEPTED_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def default_aux_layer_ids(num_layers: int) -> List[int]:
    """Target layers whose *output* residual stream the drafter reads, low to high.

    ``L >= 7``: ``[1, L//2 - 1, L - 4]`` (0-based; SGLang and vLLM capture the *inputs* of
    layers ``2, L//2, L-3`` when a checkpoint names none, the same states; ``L = 30`` gives
    ``[1, 14, 26]``).  For ``L < 7`` that formula repeats layers (``L = 5`` gives
    ``[1, 1, 1]``), which neither engine can capture, so tiny test models get three
    distinct, evenly spread layers ``[0, L//2, L-1]`` (``L >= 3``) or, for ``L < 3``,
    ``[0, 0, 0]`` / ``[0, 1, 1]`` (clamped into ``[0, L-1]``, sorted; repeats only there).

    Raises:
        ValueError: ``num_layers < 1``.
    """
    L = int(num_layers)
    if L < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers!r}")
    if L >= 7:
        return [1, L // 2 - 1, L - 4]
    if L >= 3:
        return [0, L // 2, L - 1]
    return sorted(min(max(i, 0), L - 1) for i in (0, L // 2, L - 1))


# ----------------------------------------------------------------------------- config

@dataclass
class Eagle3Config:
    """Shapes and numerics of an EAGLE-3 drafter (one layer), plus what it was trained on.

    The attention/MLP shapes default to the target's (:meth:`from_target`); ``hidden_size``
    and ``vocab_size`` must equal the target's (features, embedding and LM head are the
    target's).  ``aux_layer_ids`` are target layers (output of layer ``i``); empty means
    :func:`default_aux_layer_ids` of the target (filled in by :class:`Eagle3Drafter`).
    ``target_model``, ``target_num_layers``, ``training`` are informational (written under
    ``"specattn"`` in ``config.json``).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: Optional[int] = None
    eos_token_ids: List[int] = field(default_factory=list)
    aux_layer_ids: List[int] = field(default_factory=list)
    target_num_layers: Optional[int] = None
    target_model: Optional[str] = None
    training: dict = field(default_factory=dict)

    def __post_init__(self):
        check_decoder_shape(self, ("hidden_size", "intermediate_size", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"))
        ids = self.eos_token_ids
        self.eos_token_ids = [] if ids is None else [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        self.aux_layer_ids = [int(i) for i in (self.aux_layer_ids or [])]
        if self.aux_layer_ids and (len(self.aux_layer_ids) != 3 or min(self.aux_layer_ids) < 0):
            raise ValueError(f"aux_layer_ids must be 3 non-negative target layer ids, got {self.aux_layer_ids}")

    @classmethod
    def from_target(cls, target: LlamaConfig, num_target_layers: Optional[int] = None,
                    target_model: Optional[str] = None) -> "Eagle3Config":
        """The drafter config of a target: the target's width, MLP size, heads, head_dim, eps,
        RoPE base, vocabulary, context length and special tokens; default aux layers of its
        ``num_target_layers`` (default all) layers."""
        L = num_target_layers or target.num_hidden_layers
        return cls(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                   num_attention_heads=target.num_attention_heads,
                   num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                   vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings,
                   bos_token_id=target.bos_token_id, eos_token_ids=list(target.eos_token_ids),
                   aux_layer_ids=default_aux_layer_ids(L), target_num_layers=L, target_model=target_model)

    def param_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Checkpoint ``name -> shape`` (``[out, in]`` for linears), in file order."""
        H, I, dh = self.hidden_size, self.intermediate_size, self.head_dim
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        p = "midlayer."
        return {
            "fc.weight": (H, 3 * H),
            p + "input_layernorm.weight": (H,),
            p + "hidden_norm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * dh, 2 * H),
            p + "self_attn.k_proj.weight": (nkv * dh, 2 * H),
            p + "self_attn.v_proj.weight": (nkv * dh, 2 * H),
            p + "self_attn.o_proj.weight": (H, nh * dh),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
            "norm.weight": (H,),
        }

    def to_hf_dict(self) -> dict:
        """The checkpoint's ``config.json`` (what SGLang's and vLLM's EAGLE-3 loaders read)."""
        eos = self.eos_token_ids
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_hidden_layers": 1, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "specattn": {"target_model": self.target_model, "target_num_layers": self.target_num_layers,
                         "aux_layer_ids": list(self.aux_layer_ids), "training": self.training},
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "Eagle3Config":
        """Parse an EAGLE-3 ``config.json`` dict.

        Aux layers: ``specattn.aux_layer_ids`` if present, else
        ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the engines' key, same meaning),
        else empty (the target's defaults).

        Raises:
            ValueError: not an EAGLE-3 Llama drafter (architecture, ``model_type``,
                activation, RoPE scaling), more than one layer, a reduced draft vocabulary
                (``draft_vocab_size != vocab_size``), or missing / invalid sizes.
        """
        arch = d.get("architectures") or []
        if not any(a in _ACCEPTED_ARCHITECTURES for a in arch):
            raise ValueError(f"architectures={arch!r}: not an EAGLE-3 Llama drafter "
                             f"(expected {ARCHITECTURE!r})")
        if d.get("model_type", "llama") != "llama":
            raise ValueError(f"model_type={d.get('model_type')!r}: only 'llama' is supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r}: only 'silu' is supported")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"num_hidden_layers={d['num_hidden_layers']}: an EAGLE-3 drafter has 1 layer")
        dv = d.get("draft_vocab_size")
        if dv is not None and dv != d.get("vocab_size"):
            raise ValueError(f"draft_vocab_size={dv} != vocab_size={d.get('vocab_size')}: reduced draft "
                             f"vocabularies (d2t/t2d maps) are not supported")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope!r} is not supported (only plain RoPE)")
        ours = d.get("specattn") or {}
        aux = ours.get("aux_layer_ids") or (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
        try:
            heads = d["num_attention_heads"]
            return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                       num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
                       head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
                       rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                       max_position_embeddings=d.get("max_position_embeddings", 2048),
                       bos_token_id=d.get("bos_token_id"), eos_token_ids=d.get("eos_token_id"),
                       aux_layer_ids=list(aux), target_num_layers=ours.get("target_num_layers"),
                       target_model=ours.get("target_model"), training=ours.get("training") or {})
        except KeyError as e:
            raise ValueError(f"EAGLE-3 config is missing {e.args[0]!r}") from None


def checkpoint_nbytes(config: Eagle3Config, bytes_per_element: int = 2) -> int:
    """Tensor bytes of the checkpoint (bf16: 2 per element; the safetensors header adds ~1 KiB).
    SmolLM2-135M's drafter: 5,089,536 parameters, 10,179,072 bytes (9.71 MiB)."""
    return bytes_per_element * sum(math.prod(s) for s in config.param_shapes().values())


def init_weights(config: Eagle3Config, seed: int = 0, std: float = 0.02, norm_jitter: float = 0.0
                 ) -> Dict[str, torch.Tensor]:
    """Fresh float32 CPU weights, deterministic in ``seed``: linears ~ N(0, std^2) (HF's
    ``initializer_range``), norm weights ``1`` (+ ``norm_jitter * N(0, 1)``, for tests that
    must tell the norms apart)."""
    return random_init(config.param_shapes(), seed, std, norm_jitter)


# ----------------------------------------------------------------------------- drafter

class Eagle3Drafter(TargetSharingDrafter):
    """The EAGLE-3 drafter of a :class:`~specattn.spec_runtime.model.LlamaModel` target.

    Shares the target's embedding table and LM head (frozen, never copied); owns ``fc``, the
    mid layer and the final ``norm`` (:attr:`w`, checkpoint names, on ``target.device`` in
    :attr:`dtype`).

    Args:
        target: the target model (a ``LlamaModel``: ``config``, ``w``, ``lm_head``,
            ``device``, ``dtype``, ``num_layers``).
        config: :class:`Eagle3Config`; empty ``aux_layer_ids`` become the target's defaults.
        weights: checkpoint-named tensors (any dtype/device), or None for a random init
            (:func:`init_weights`, deterministic in ``seed``).
        seed: init seed when ``weights`` is None.
        dtype: the drafter's weights/activations dtype (default the target's; training keeps
            float32 master weights).
        init_std: std of the random linear init.

    Raises:
        ValueError: hidden size / vocabulary differ from the target's, aux layers outside the
            target, or ``weights`` with missing / unexpected / misshapen tensors.
    """

    num_layers = 1

    def __init__(self, target, config: Eagle3Config, weights: Optional[Dict[str, torch.Tensor]] = None,
                 seed: int = 0, *, dtype: Optional[torch.dtype] = None, init_std: float = 0.02):
        for attr in ("config", "w", "lm_head", "device", "dtype", "num_layers"):
            if not hasattr(target, attr):
                raise ValueError(f"the EAGLE-3 drafter needs a Llama target (spec_runtime.model.LlamaModel); "
                                 f"{type(target).__name__} has no {attr!r}")
        tc = target.config
        if config.hidden_size != tc.hidden_size:
            raise ValueError(f"drafter hidden_size={config.hidden_size} != target hidden_size={tc.hidden_size}")
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab_size={config.vocab_size} != target vocabulary {target.vocab_size}")
        if not config.aux_layer_ids:
            config = _replace(config, aux_layer_ids=default_aux_layer_ids(target.num_layers),
                              target_num_layers=target.num_layers)
        if max(config.aux_layer_ids) >= target.num_layers:
            raise ValueError(f"aux_layer_ids={config.aux_layer_ids} outside the target's {target.num_layers} layers")
        self.target, self.config = target, config
        self.device = target.device
        self.dtype = dtype or target.dtype
        if weights is None:
            weights = init_weights(config, seed, init_std)
        _check_weights(config, weights, "weights")
        self.w: Dict[str, torch.Tensor] = {k: weights[k].detach().to(self.device, self.dtype).contiguous()
                                           for k in config.param_shapes()}
        self.layer = AttentionLayer.mha(0, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.cos_sin_cache: Optional[torch.Tensor] = None   # set by reserve_positions: the fused path
        self._w_qkv: Optional[torch.Tensor] = None         # fused path (reserve_positions)
        self._w_gate_up: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._head_folded: Optional[torch.Tensor] = None
        self.draft_vocab: Optional[torch.Tensor] = None     # set_draft_vocab: a reduced draft vocabulary
        self._draft_head: Optional[torch.Tensor] = None

    def reserve_positions(self, n: int) -> None:
        """Enable the fused inference path (one :func:`specattn.ops.qkv_rope_store` launch
        for the norms, Q/K/V, RoPE and the KV store) for positions ``0 .. n-1``: the RoPE
        table, ``cat(q, k, v)``, and the gate / up and LM-head weights with the norm that
        reads them folded in (:func:`specattn.ops.fold_rms_norm_weight`: the residual GEMM
        before each hands it the rows' sums of squares), built from :attr:`w` now: call it
        again after changing the weights.  The engine calls it with its ``max_context``."""
        c, p, w = self.config, "midlayer.", self.w
        if self.cos_sin_cache is None or self.cos_sin_cache.shape[0] < n:
            self.cos_sin_cache = ops.make_cos_sin_cache(max(int(n), 1), c.head_dim, c.rope_theta, device=self.device)
        with torch.no_grad():
            # (the two QKV inputs have no producer to hand their norms over: unfolded)
            self._w_qkv = torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).detach().contiguous()
            self._w_gate_up = tuple(ops.fold_rms_norm_weight(w[p + f"mlp.{x}_proj.weight"],
                                                             w[p + "post_attention_layernorm.weight"])
                                    for x in ("gate", "up"))
        self._fold_head()

    def _fold_head(self) -> None:
        """The LM head (the draft vocabulary's rows when set) times the final norm's weight,
        for :meth:`logits` on the fused path."""
        if self._w_qkv is not None:
            head = self.lm_head if self._draft_head is None else self._draft_head
            with torch.no_grad():
                self._head_folded = ops.fold_rms_norm_weight(head, self.w["norm.weight"])

    # ------------------------------------------------------------------ construction / io
    @classmethod
    def from_target(cls, target, seed: int = 0, *, dtype: Optional[torch.dtype] = None,
                    init_std: float = 0.02, target_model: Optional[str] = None) -> "Eagle3Drafter":
        """A fresh random drafter whose config is derived from the target's
        (:meth:`Eagle3Config.from_target`)."""
        cfg = Eagle3Config.from_target(target.config, target.num_layers, target_model)
        return cls(target, cfg, None, seed, dtype=dtype, init_std=init_std)

    @classmethod
    def load(cls, path, target, *, dtype: Optional[torch.dtype] = None,
             draft_vocab_size: Optional[int] = None) -> "Eagle3Drafter":
        """Load ``path/config.json`` + ``path/model.safetensors`` for ``target``;
        ``draft_vocab_size``: draft only from that many of the most frequent tokens of
        ``path/token_frequencies.json`` (:meth:`set_draft_vocab`; None or the vocabulary
        size: all).

        Raises:
            FileNotFoundError: missing folder or files.  ValueError: not an EAGLE-3 config,
                or its hidden size / vocabulary / aux layers / tensors do not fit ``target``
                (the message says which), or a bad ``draft_vocab_size``.
        """
        from safetensors.torch import load_file
        path = Path(path)
        cfg_file, w_file = path / CONFIG_FILE, path / WEIGHTS_FILE
        for f in (cfg_file, w_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f} not found (an EAGLE-3 drafter folder has {CONFIG_FILE} "
                                        f"and {WEIGHTS_FILE})")
        try:
            config = Eagle3Config.from_hf_dict(json.loads(cfg_file.read_text()))
        except ValueError as e:
            raise ValueError(f"{cfg_file}: {e}") from None
        weights = load_file(str(w_file), device="cpu")
        try:
            drafter = cls(target, config, weights, dtype=dtype)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        drafter.load_draft_vocab(path, draft_vocab_size)
        return drafter

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Checkpoint-named tensors (detached, the drafter's dtype and device)."""
        return {k: v.detach() for k, v in self.w.items()}

    def save(self, path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (bf16) into folder ``path``
        (created).  Returns ``Path(path)``."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_hf_dict(), indent=2) + "\n")
        tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in self.w.items()}
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path / WEIGHTS_FILE, 0o666 & ~umask)   # the writer may create it 0600
        return path

    # ------------------------------------------------------------------ properties

    @property
    def aux_layer_ids(self) -> List[int]:
        return list(self.config.aux_layer_ids)

    # ------------------------------------------------------------------ the layer
    def project_hidden(self, hidden_in: torch.Tensor) -> torch.Tensor:
        """``[..., 3H]`` target features -> ``fc`` -> ``[..., H]``; ``[..., H]`` (the drafter's
        own prenorm output) passes through.  Raises ValueError for any other width."""
        H = self.config.hidden_size
        if hidden_in.shape[-1] == 3 * H:
            return hidden_in @ self.w["fc.weight"].T
        if hidden_in.shape[-1] == H:
            return hidden_in
        raise ValueError(f"hidden_in must have width 3*{H} (target features) or {H} (drafter hidden), "
                         f"got {tuple(hidden_in.shape)}")

    def _qkv(self, e: torch.Tensor, h: torch.Tensor):
        """``e, h [N, H]`` -> ``q [N, nh, hd], k, v [N, nkv, hd]`` (before RoPE)."""
        c, w, p = self.config, self.w, "midlayer."
        N = e.shape[0]
        x = torch.cat([rms_norm(e, w[p + "input_layernorm.weight"], c.rms_norm_eps),
                       rms_norm(h, w[p + "hidden_norm.weight"], c.rms_norm_eps)], dim=-1)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(N, c.num_attention_heads, c.head_dim)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(N, c.num_key_value_heads, c.head_dim)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(N, c.num_key_value_heads, c.head_dim)
        return q, k, v

    def _finish(self, residual: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """``residual [N, H]``, attention output ``o [N, nh*hd]`` -> prenorm ``h3 [N, H]``."""
        c, w, p = self.config, self.w, "midlayer."
        h2 = residual + o @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h2, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        g = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        return h2 + g @ w[p + "mlp.down_proj.weight"].T

    def head_hidden(self, prenorm: torch.Tensor) -> torch.Tensor:
        """``norm(prenorm)``: what the LM head reads."""
        return rms_norm(prenorm, self.w["norm.weight"], self.config.rms_norm_eps)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """``prenorm [N, H]`` -> float32 logits ``[N, V]`` over the target's full vocabulary,
        or ``[N, len(draft_vocab)]`` over the draft vocabulary when one is set
        (:meth:`set_draft_vocab`; column ``j`` is token ``draft_vocab[j]``): final norm + LM
        head in one fused op on CUDA (:func:`specattn.ops.rms_norm_matmul`, its reference
        elsewhere; inference only, no autograd: training reads :meth:`head_hidden`)."""
        return self._logits(prenorm)

    def _logits(self, prenorm: torch.Tensor, row_sumsq: Optional[torch.Tensor] = None,
                top_k: Optional[int] = None):
        """float32 logits, or with ``top_k`` (the folded head only) the top-``k`` ``(values,
        token ids)`` of :func:`specattn.ops.rms_norm_matmul_topk` (a draft vocabulary's
        columns mapped to token ids in its merge)."""
        if self._head_folded is not None and not self.w["norm.weight"].requires_grad:
            if top_k is not None and top_k <= min(ops.TOPK_MAX_K, self._head_folded.shape[0]):
                return ops.rms_norm_matmul_topk(prenorm, None, self._head_folded, self.config.rms_norm_eps,
                                                top_k, row_sumsq=row_sumsq, column_ids=self.draft_vocab)
            return ops.rms_norm_matmul(prenorm, None, self._head_folded, self.config.rms_norm_eps,
                                       out_dtype=torch.float32, row_sumsq=row_sumsq)
        head = self.lm_head if self._draft_head is None else self._draft_head
        return ops.rms_norm_matmul(prenorm, self.w["norm.weight"], head, self.config.rms_norm_eps,
                                   out_dtype=torch.float32)

    def set_draft_vocab(self, token_ids: Optional[torch.Tensor]) -> None:
        """Draft only from ``token_ids`` (int ``[V']``, distinct target token ids; None: the
        full vocabulary again).  The LM head of every draft step then runs over those rows
        of the target's head (copied once, ``V' x H``), so its cost shrinks ``V / V'``
        times; tokens outside are never drafted, and a draft the target rejects costs only
        acceptance, never correctness (the verify is unchanged).  This is FR-Spec's
        frequency-ranked draft vocabulary (Zhao et al., "FR-Spec: Accelerating
        Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", arXiv
        2502.14856) and what EAGLE-3 checkpoints with a ``d2t`` map do, without a trained
        head of its own: :func:`frequent_tokens` ranks tokens by their count in the target's
        outputs.  Logits columns map back to token ids with :meth:`draft_token_ids`.

        Raises:
            ValueError: not a 1-D integer tensor, empty, repeated ids, or ids outside
                ``[0, vocab_size)``.
        """
        if token_ids is None:
            self.draft_vocab = self._draft_head = None
            self._fold_head()
            return
        self.draft_vocab = self._check_draft_vocab(token_ids)
        self._draft_head = self.lm_head[self.draft_vocab].contiguous()
        self._fold_head()

    # ------------------------------------------------------------------ inference
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                hidden_in: torch.Tensor, logit_rows: Optional[torch.Tensor] = None,
                top_k: Optional[int] = None, hidden_rows: Optional[torch.Tensor] = None):
        """One drafter forward through the attention backend (any mode; CUDA-graph safe: no
        host syncs, shapes fixed by the inputs).

        Args:
            input_ids: int64 ``[T]``: the token each entry embeds (``x_{t+1}`` for the entry
                of target position ``t``; the draft token at a draft step).
            batch: the forward's :class:`ForwardBatch` (the caller has run
                ``backend.init_forward_metadata(batch)``); RoPE positions are
                ``batch.positions`` (``t`` for the entry of target position ``t``), K/V are
                written at ``batch.out_cache_loc``.
            backend: attention backend over a pool from :meth:`make_kv_pool`.
            hidden_in: ``[T, 3H]`` target features (aux layers concatenated) or ``[T, H]``
                the drafter's previous prenorm output; with ``hidden_rows``, ``[N, 3H or H]``.
            hidden_rows: int64 ``[T]`` in ``[0, N)``: entry ``t`` reads ``hidden_in[hidden_rows[t]]``
                (one gather, which also gives the layer its own residual buffer: an EAGLE
                draft step's beams reading the rows of the beams they continue).
            logit_rows: int64 ``[R]``: run the final norm + LM head on those rows only.
            top_k: on the fused path (CUDA, inference), return the ``top_k`` (1-16) best
                log-probabilities per row and their token ids in place of the logits
                (:func:`specattn.ops.rms_norm_matmul_topk`).

        Returns:
            ``(prenorm [T, H] in the drafter's dtype, logits [T or R, V] float32)`` (``V``:
            the draft vocabulary's size when one is set), or with ``top_k`` on the fused path
            ``(prenorm, (values float32 [T or R, top_k], token ids int64 [T or R, top_k]))``.

        Raises:
            ValueError: ``hidden_in`` of the wrong shape.
        """
        c = self.config
        T = input_ids.shape[0]
        if hidden_rows is not None:
            if hidden_in.dim() != 2 or hidden_rows.shape != (T,):
                raise ValueError(f"hidden_rows must be [T={T}] rows of a 2-d hidden_in, got "
                                 f"{tuple(hidden_rows.shape)} of {tuple(hidden_in.shape)}")
            hidden_in = hidden_in.index_select(0, hidden_rows)
        if hidden_in.dim() != 2 or hidden_in.shape[0] != T:
            raise ValueError(f"hidden_in must be [T={T}, 3H or H], got {tuple(hidden_in.shape)}")
        h = self.project_hidden(hidden_in.to(self.dtype))
        e = self.embed_tokens[input_ids].to(self.dtype)
        fused = self._w_qkv is not None and not self.w["fc.weight"].requires_grad
        if fused:
            # norms of both inputs, Q/K/V, RoPE and the KV store in one launch (positions are
            # the engine's, inside the table reserve_positions built)
            pool, p = backend.kv_pool, "midlayer."
            q = ops.qkv_rope_store(e, self.w[p + "input_layernorm.weight"], self._w_qkv, c.rms_norm_eps,
                                   batch.positions, self.cos_sin_cache, batch.out_cache_loc,
                                   pool.get_key_buffer(0), pool.get_value_buffer(0), c.num_attention_heads,
                                   c.num_key_value_heads, c.head_dim, x2=h,
                                   norm_weight2=self.w[p + "hidden_norm.weight"], check_values=False,
                                   **dict(zip(("k_scale", "v_scale"), pool.kv_scales(0))))
            o = backend.forward(q, None, None, self.layer, batch, save_kv_cache=False)
        else:
            q, k, v = self._qkv(e, h)
            cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = backend.forward(q, k.contiguous(), v.contiguous(), self.layer, batch)
        # the layer's tail in three fused ops (their references on the CPU: the same math as
        # _finish): h += o @ Wo^T; act = SwiGLU(norm(h)); h += act @ Wd^T
        p, w = "midlayer.", self.w
        # the residual stream is updated in place: never in the caller's tensor (a gathered
        # hidden_in is the layer's own)
        res = h.clone() if hidden_rows is None and h.data_ptr() == hidden_in.data_ptr() else h
        if fused:  # norm weights folded in; each residual GEMM hands its rows' sums of squares on
            _, ss = ops.matmul_residual(o.reshape(T, -1), w[p + "self_attn.o_proj.weight"], res,
                                        return_row_sumsq=True)
            act = ops.rms_norm_swiglu(res, None, *self._w_gate_up, c.rms_norm_eps, row_sumsq=ss)
            _, ss = ops.matmul_residual(act, w[p + "mlp.down_proj.weight"], res, return_row_sumsq=True)
            if logit_rows is None:
                return res, self._logits(res, ss, top_k)
            return res, self._logits(res[logit_rows], None, top_k)
        ops.matmul_residual(o.reshape(T, -1), w[p + "self_attn.o_proj.weight"], res)
        act = ops.rms_norm_swiglu(res, w[p + "post_attention_layernorm.weight"], w[p + "mlp.gate_proj.weight"],
                                  w[p + "mlp.up_proj.weight"], c.rms_norm_eps)
        ops.matmul_residual(act, w[p + "mlp.down_proj.weight"], res)
        return res, self.logits(res if logit_rows is None else res[logit_rows])

    # ------------------------------------------------------------------ training (dense)
    def dense_forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      segments: Optional[torch.Tensor] = None, ttt_steps: int = 1) -> List[torch.Tensor]:
        """Training-time test over whole sequences, differentiable (SpecForge's TTT unroll).

        Row ``t`` of a sequence is the entry of target position ``t``.  Step 0: it embeds
        ``tokens[t+1]``, reads ``fc(features[t])``, RoPE position ``positions[t]``, and
        attends causally to the step-0 keys of rows ``<= t`` of its own sequence.  Step
        ``k >= 1``: it embeds ``tokens[t+1+k]``, reads its own step ``k-1`` prenorm output
        (no ``fc``), RoPE position ``positions[t] + k``, and attends to the same step-0 keys
        plus its own keys of steps ``1..k`` (one joint softmax) -- exactly the cache-based
        :meth:`forward` of a chain drafted from entry ``t`` with the true tokens as drafts.
        Rows whose ``tokens[t+1+k]`` lies past the row or in another sequence compute
        garbage that only they see (callers mask their loss).

        Args:
            tokens: int64 ``[B, T]`` token ids (several sequences may be packed per row).
            features: ``[B, T, 3H]`` target features (the aux layers' states concatenated).
            positions: int64 ``[B, T]``: each token's position in its own sequence.
            segments: int64 ``[B, T]`` sequence id of each token (``-1`` = padding); attention
                never crosses sequences.  None: one sequence per row.
            ttt_steps: steps to unroll (>= 1).

        Returns:
            ``ttt_steps`` prenorm tensors ``[B, T, H]`` (logits: :meth:`logits` /
            :meth:`head_hidden`).

        Raises:
            ValueError: inconsistent shapes or ``ttt_steps < 1``.
        """
        c = self.config
        B, T = tokens.shape
        if features.shape != (B, T, 3 * c.hidden_size) or positions.shape != (B, T):
            raise ValueError(f"need tokens/positions [B, T] and features [B, T, {3 * c.hidden_size}], got "
                             f"{tuple(tokens.shape)}, {tuple(positions.shape)}, {tuple(features.shape)}")
        if segments is not None and segments.shape != (B, T):
            raise ValueError(f"segments must be [B, T] = {(B, T)}, got {tuple(segments.shape)}")
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        G, dev = nh // nkv, tokens.device
        idx = torch.arange(T, device=dev)
        mask0 = idx[None, :] <= idx[:, None]                                   # [T, T] causal
        if segments is not None:
            mask0 = mask0 & (segments[:, :, None] == segments[:, None, :])     # [B, T, T]
        mask0 = (mask0 | torch.eye(T, dtype=torch.bool, device=dev)).expand(B, T, T)  # padding sees itself
        scale = hd ** -0.5
        h = self.project_hidden(features.reshape(B * T, -1))
        k0 = v0 = None
        kd: List[torch.Tensor] = []
        vd: List[torch.Tensor] = []
        outs = []
        for step in range(ttt_steps):
            shift = 1 + step
            tok = torch.cat([tokens[:, shift:], tokens.new_zeros(B, min(shift, T))], 1)[:, :T]
            e = self.embed_tokens[tok.reshape(-1)]
            q, k, v = self._qkv(e, h)
            cos, sin = rope_cos_sin((positions + step).reshape(-1), hd, c.rope_theta, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # [B, nkv, G, T, hd] queries, [B, nkv, T, hd] keys/values
            q = q.view(B, T, nkv, G, hd).permute(0, 2, 3, 1, 4)
            k = k.view(B, T, nkv, hd).transpose(1, 2)
            v = v.view(B, T, nkv, hd).transpose(1, 2)
            if step == 0:
                k0, v0 = k, v
            else:
                kd.append(k)
                vd.append(v)
            # attention in float32 (as the backends accumulate), also under bf16 autocast
            with torch.autocast(dev.type, enabled=False):
                qf = q.float()
                s = (qf @ k0[:, :, None].float().transpose(-1, -2)) * scale     # [B, nkv, G, T, T]
                s = s.masked_fill(~mask0[:, None, None], float("-inf"))
                if kd:  # each row's own chain keys of steps 1..step (the diagonal)
                    sd = torch.stack([(qf * kj[:, :, None].float()).sum(-1) for kj in kd], -1) * scale
                    s = torch.cat([s, sd], -1)                                 # [B, nkv, G, T, T+step]
                p = torch.softmax(s, dim=-1)
                o = p[..., :T] @ v0[:, :, None].float()                         # [B, nkv, G, T, hd]
                for j, vj in enumerate(vd):
                    o = o + p[..., T + j, None] * vj[:, :, None].float()
            o = o.to(q.dtype).permute(0, 3, 1, 2, 4).reshape(B * T, nh * hd)    # head = kv * G + g
            h = self._finish(h, o)
            outs.append(h.view(B, T, -1))
        return outs


# ----------------------------------------------------------------------------- helpers

def _replace(config: Eagle3Config, **kw) -> Eagle3Config:
    from dataclasses import replace
    return replace(config, **kw)


def _check_weights(config: Eagle3Config, weights: Dict[str, torch.Tensor], source: str) -> None:
    own = sorted(n for n in weights if n in ("d2t", "t2d") or n.endswith(("lm_head.weight", "embed_tokens.weight")))
    if own:
        raise ValueError(f"{source}: has {own}: drafters with their own embedding / LM head / reduced "
                         f"vocabulary are not supported (this drafter uses the target's)")
    check_weight_shapes(config.param_shapes(), weights, source)
