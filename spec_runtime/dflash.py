"""DFlash speculative decoding in the reference runtime: a small non-causal *block* drafter
that reads the target's hidden states, and lossless verification of its block as a chain.

What DFlash is (Chen, Liang and Liu, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv 2602.06036; z-lab's reference model ``dflash/model.py`` of
github.com/z-lab/dflash and SGLang's ``--speculative-algorithm DFLASH``
(``python/sglang/srt/models/dflash.py``, ``speculative/dflash_utils.py``); facts only, no code
taken from either -- details and sources in ``docs/drafters.md``)
---------------------------------------------------------------------------------------
- The drafter is a few transformer layers of the target's width (Qwen3-style: per-head Q and
  K RMSNorm, RoPE, SwiGLU MLP, no biases) that shares the target's token embeddings and LM
  head; its checkpoint holds neither.
- Context: the target's residual stream after a few chosen layers (``target_layer_ids``; by
  default as many as the drafter has layers: one -> the middle layer, several -> evenly
  spaced over layers ``1 .. n-3``) is concatenated per token, projected by ``fc`` and
  normalized (``hidden_norm``).  That *context hidden* feeds the K/V projections of every
  draft layer directly (no ``input_layernorm``; K then gets the layer's K RMSNorm and RoPE at
  the token's position); the drafter never runs queries for context tokens.  SGLang keeps
  these K/V in a draft KV cache and appends the newly committed tokens' K/V after every
  verify (``_append_target_hidden_to_draft_kv``), fused across layers when it can
  (``FusedKVMaterializeHelper``) -- here: :func:`specattn.ops.materialize_kv`.
- Drafting is ONE forward over a block of ``B`` positions ``P .. P+B-1``: position ``P``
  holds the last verified token (the *root*, known), the others the embedding of the mask
  token -- a token id of the target's own vocabulary (``dflash_config.mask_token_id``; z-lab
  adds ``<|MASK|>`` to the tokenizer, which only works where the embedding table has spare
  rows), embedded by the target's frozen table.  Attention is non-causal inside the block
  and sees all the context.  The outputs at block positions ``1 .. B-1`` give the ``B-1``
  draft tokens (argmax), the token AT that position (not after it).  The block's own K/V are
  scratch: SGLang allocates their slots for the draft forward and drops them afterwards.
- Verification: root + ``B-1`` drafts form a chain of ``D = B`` tokens, verified by the target
  in one forward (greedy: longest prefix of drafts equal to the target's argmax); the target's
  hidden states of the accepted tokens become the next context.
- Training (:meth:`DFlashDrafter.dense_forward`, ``train_drafter.py``): random *anchors* (a
  generated token as root) per sequence, one block per anchor; a block sees the context
  strictly before its anchor and its own block, never another block; block position ``k``
  is trained towards the token at ``anchor + k`` with the loss weight
  ``exp(-(k - 1) / gamma)``.

Our choices: the mask token of SmolLM2 (whose 49,152-row table has no spare row) is its
reserved ``<empty_output>`` special token, id 16 (:data:`DEFAULT_MASK_TOKEN_ID`), never seen
in chat data; the number of context taps is independent of the drafter's depth and is
written into the checkpoint (``target_layer_ids``); the drafter's MLP may be narrower than the
target's (``intermediate_size``, to fit a size budget).  A drafter the engine builds by
itself (``DFlashStrategy``) is random-initialised (acceptance ~0 on real text: reported, not
hidden); a trained one is loaded with :meth:`DFlashDrafter.load`.

Checkpoint (:meth:`DFlashDrafter.save`, z-lab's layout, what SGLang's ``DFlashDraftModel``
loads): ``config.json`` (Qwen3-style; ``architectures: ["DFlashDraftModel"]``,
``model_type: "qwen3"``, ``num_hidden_layers``, ``layer_types`` all ``"full_attention"``,
top-level ``block_size`` and ``num_target_layers``, ``dflash_config: {block_size,
mask_token_id, target_layer_ids}``; our own fields under ``"specattn"``) and
``model.safetensors`` in bf16 with exactly :meth:`DFlashConfig.param_shapes`'s names:
``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.input_layernorm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.post_attention_layernorm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``norm.weight``.  In memory the K/V projections of all layers are stacked into one ``w_kv``
(the layout of :func:`specattn.ops.materialize_kv`) and the K norms into ``k_norm``; save and
load convert.

How it maps onto our modes and pools (one round per running batch)
------------------------------------------------------------------
Per request ``P`` = target KV committed (= drafter context KV committed: both cover positions
``0 .. P-1``), ``root`` = last emitted token, no KV anywhere yet.  Target and drafter pools
use the same slot indices, reserved per request row by the engine.

1. slots: the round works at positions ``P .. P+B-1`` (``req_to_token[row, P : P+B]``);
2. draft (:meth:`DFlashStrategy.propose_block`): the drafter runs ``TARGET_VERIFY`` on its own backend/pool
   with ``prefix_lens = P``, ``D = B`` tokens ``[root, MASK x (B-1)]`` at positions
   ``P .. P+B-1`` and an ALL-ONES tree mask.  Our ``TARGET_VERIFY`` means "prefix always
   visible + block tokens visible where the mask bit is set", so all-ones is exactly
   non-causal block attention over context + block (SGLang runs its DFlash draft block in
   ``TARGET_VERIFY`` without a custom mask for the same reason).  The forward writes the
   block's (scratch) K/V into the round's slots; step 6 overwrites or frees them;
3. verify: ``TARGET_VERIFY`` on the target over the chain ``[root, d_1 .. d_{B-1}]``
   (lower-triangular mask, positions ``P + j``: :func:`chain_tree`, equal to
   ``ops.build_tree`` for ``topk = 1``), capturing the target's hidden states at the tap
   layers; ``verify_tree_greedy`` or ``tree_speculative_sampling`` (lossless; the drafts are
   deterministic argmaxes, so "target only" acceptance ``u <= q(d)`` is exact);
4. ``compact_accepted_path`` (tokens and captured hidden states) + one target KV move (for a
   chain the accepted path is already in place: identity pairs, kept for generality);
5. emit accepted drafts + bonus; ``accept_length`` per round as EAGLE (bonus excluded);
6. drafter context KV for the committed tokens (root + accepted drafts, positions
   ``P .. P+a``) via ``materialize_kv`` from the compacted hidden states, overwriting the
   block's scratch K/V in those slots.  The kernel writes all ``B`` rows (a fixed shape):
   the rows past the accepted path land at positions ``> P + a``, which the next round's
   block forward overwrites before anything reads them as context.  Commit ``P += a + 1``;
   the bonus is the new root.

Prefill (:meth:`DFlashStrategy.prefill`): the target's EXTEND over the prompt captures the
tap layers, and the prompt's context KV is materialized from them in the same pass.

CUDA graphs: the whole round (block forward, verify with the tap layers, compaction,
``materialize_kv``, commit) is one graph on backends that build their metadata on the
device; on host-planned backends the block forward replays a per-mode graph and the
verify (which returns hidden states) runs eagerly.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from specattn import ops
from specattn.backends import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode, pack_tree_mask

from .loader import LlamaConfig, check_decoder_shape, check_weight_shapes
from .drafter_base import TargetSharingDrafter, random_init
from .model import LlamaModel, apply_rope, rms_norm, rope_cos_sin
from .strategies import PrefillBatch, SpecConfig, Strategy, check_draft_vocab_topk

if TYPE_CHECKING:  # the engine imports this module
    from .engine import Engine, RoundBatch

__all__ = ["ARCHITECTURE", "DEFAULT_MASK_TOKEN_ID", "context_layer_ids", "default_mask_token_id", "DFlashConfig",
           "checkpoint_nbytes", "fit_intermediate_size", "init_weights", "DFlashDrafter", "chain_tree",
           "DFlashStrategy"]

ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
#: SmolLM2's reserved ``<empty_output>`` (a StarCoder-era special token that chat data never
#: holds): the mask token of drafters for targets whose vocabulary has no spare row
DEFAULT_MASK_TOKEN_ID = 16
#: what the safetensors JSON header of a drafter may add to the tensor bytes (generous)
HEADER_ALLOWANCE = 8 * 1024
#: ``dflash_config`` keys of DFlash variants this runtime does not implement (DFlash2's
#: dynamic convolutions and candidate selector, Domino projectors, attention sinks)
_UNSUPPORTED_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "projector_type",
                     "attention_sink_bias", "attention_value_scale")


def context_layer_ids(num_target_layers: int, num_taps: int) -> List[int]:
    """Target layers whose output residual stream feeds the drafter (DFlash's rule: one tap ->
    the middle layer; ``k`` taps -> rounded evenly spaced over layers ``1 .. n-3``).  Targets
    too shallow for that span (``n - 3 <= 1``, e.g. tiny test models) spread the taps over
    ``0 .. n-1`` instead.  Layer ``i`` means "after layer ``i``" (HF ``hidden_states[i+1]``,
    our ``capture_layers=[i]``).

    Raises:
        ValueError: ``num_taps < 1`` or ``num_target_layers < 1``.
    """
    n, k = int(num_target_layers), int(num_taps)
    if n < 1 or k < 1:
        raise ValueError(f"need num_target_layers >= 1 and num_taps >= 1, got {n}, {k}")
    if k == 1:
        return [n // 2]
    start, end = (1, n - 3) if n - 3 > 1 else (0, n - 1)
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


def default_mask_token_id(vocab_size: int) -> int:
    """:data:`DEFAULT_MASK_TOKEN_ID` (16) when the vocabulary holds it, else ``vocab_size - 1``."""
    return DEFAULT_MASK_TOKEN_ID if vocab_size > DEFAULT_MASK_TOKEN_ID else int(vocab_size) - 1


# ----------------------------------------------------------------------------- config

@dataclass
class DFlashConfig:
    """Shapes and numerics of a DFlash drafter, plus what it was trained on.

    ``hidden_size`` and ``vocab_size`` must equal the target's (context features, embedding
    and LM head are the target's); heads, ``head_dim`` and ``intermediate_size`` default to
    the target's but are the drafter's own.  ``target_layer_ids``: target layers (output of
    layer ``i``) whose residual streams feed ``fc``, in concatenation order.
    ``num_target_layers``: the target's depth (a checkpoint only fits a target of that
    depth).  ``block_size``: the block the drafter was trained for (root + ``block_size - 1``
    drafts).  ``mask_token_id``: a token id of the target's vocabulary.  ``target_model``
    and ``training`` are informational (``config.json`` ``"specattn"``).

    Raises (on construction):
        ValueError: a non-positive size, heads not a multiple of KV heads, odd ``head_dim``,
            ``block_size < 2``, no / negative ``target_layer_ids``, ``mask_token_id`` outside
            ``[0, vocab_size)``.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_hidden_layers: int = 2
    target_layer_ids: List[int] = field(default_factory=list)
    num_target_layers: Optional[int] = None
    block_size: int = 16
    mask_token_id: int = DEFAULT_MASK_TOKEN_ID
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: Optional[int] = None
    eos_token_ids: List[int] = field(default_factory=list)
    target_model: Optional[str] = None
    training: dict = field(default_factory=dict)

    def __post_init__(self):
        check_decoder_shape(self, ("hidden_size", "intermediate_size", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "vocab_size", "num_hidden_layers",
                                   "block_size", "max_position_embeddings"))
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (root + drafts), got {self.block_size}")
        self.target_layer_ids = [int(i) for i in (self.target_layer_ids or [])]
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids must be >= 1 non-negative target layer ids, got {self.target_layer_ids}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(f"target_layer_ids={self.target_layer_ids} outside the {self.num_target_layers} "
                             f"target layers")
        if not isinstance(self.mask_token_id, int) or isinstance(self.mask_token_id, bool) \
                or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id!r} must be a token id in [0, {self.vocab_size})")
        ids = self.eos_token_ids
        self.eos_token_ids = [] if ids is None else [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]

    @property
    def num_context_features(self) -> int:
        """Number of target layers concatenated into ``fc``'s input."""
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target: LlamaConfig, num_layers: int = 2, num_context_layers: int = 3, *,
                    context_layers: Optional[Sequence[int]] = None, intermediate_size: Optional[int] = None,
                    block_size: int = 16, mask_token_id: Optional[int] = None,
                    num_target_layers: Optional[int] = None, target_model: Optional[str] = None) -> "DFlashConfig":
        """The drafter config of a target: its width, heads, head_dim, eps, RoPE base,
        vocabulary, context length and special tokens; ``num_layers`` draft layers;
        ``context_layers`` (default :func:`context_layer_ids` of ``num_context_layers`` taps
        over the target's ``num_target_layers``, default all); MLP width
        ``intermediate_size`` (default the target's); the mask token
        (default :func:`default_mask_token_id`)."""
        n = int(num_target_layers or target.num_hidden_layers)
        taps = list(context_layers) if context_layers is not None else context_layer_ids(n, num_context_layers)
        return cls(hidden_size=target.hidden_size, intermediate_size=int(intermediate_size or target.intermediate_size),
                   num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                   head_dim=target.head_dim, vocab_size=target.vocab_size, num_hidden_layers=int(num_layers),
                   target_layer_ids=taps, num_target_layers=n, block_size=int(block_size),
                   mask_token_id=default_mask_token_id(target.vocab_size) if mask_token_id is None else mask_token_id,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                   max_position_embeddings=target.max_position_embeddings, bos_token_id=target.bos_token_id,
                   eos_token_ids=list(target.eos_token_ids), target_model=target_model)

    def param_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Checkpoint ``name -> shape`` (z-lab's names; ``[out, in]`` for linears), in file order."""
        H, I, dh = self.hidden_size, self.intermediate_size, self.head_dim
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        out: Dict[str, Tuple[int, ...]] = {"fc.weight": (H, self.num_context_features * H), "hidden_norm.weight": (H,)}
        for i in range(self.num_hidden_layers):
            p = f"layers.{i}."
            out.update({
                p + "input_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (nh * dh, H),
                p + "self_attn.k_proj.weight": (nkv * dh, H),
                p + "self_attn.v_proj.weight": (nkv * dh, H),
                p + "self_attn.o_proj.weight": (H, nh * dh),
                p + "self_attn.q_norm.weight": (dh,),
                p + "self_attn.k_norm.weight": (dh,),
                p + "post_attention_layernorm.weight": (H,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            })
        out["norm.weight"] = (H,)
        return out

    def to_hf_dict(self) -> dict:
        """The checkpoint's ``config.json`` (the fields z-lab's ``DFlashDraftModel`` and
        SGLang's DFlash loader read; ``block_size`` and the DFlash fields both at the top level
        and under ``dflash_config``, as z-lab's older and newer configs place them)."""
        eos, L = self.eos_token_ids, self.num_hidden_layers
        return {
            "architectures": [ARCHITECTURE], "model_type": "qwen3",
            "attention_bias": False, "attention_dropout": 0.0,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": L,
            "layer_types": ["full_attention"] * L, "max_window_layers": L,
            "use_sliding_window": False, "sliding_window": None,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": None, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "tie_word_embeddings": False, "dtype": "bfloat16",
            "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": self.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            "specattn": {"target_model": self.target_model, "training": self.training},
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DFlashConfig":
        """Parse a DFlash ``config.json`` dict (z-lab's / SpecForge's layout).

        ``block_size``, ``mask_token_id``, ``target_layer_ids`` and ``num_target_layers`` are
        read from ``dflash_config`` first, then from the top level (both layouts exist);
        without ``target_layer_ids`` the taps follow DFlash's rule over ``num_target_layers``
        with as many taps as draft layers (:func:`context_layer_ids`).

        Raises:
            ValueError: not a ``DFlashDraftModel`` (or a DFlash variant with extra modules:
                convolutions, candidate selector, Domino, attention sinks), attention bias,
                sliding-window / causal layers, RoPE scaling, logit multiplier / soft-capping,
                a non-SiLU MLP, no ``mask_token_id`` (this runtime has no tokenizer to resolve
                ``<|MASK|>``), or missing / invalid sizes.
        """
        arch = d.get("architectures") or []
        if ARCHITECTURE not in arch:
            raise ValueError(f"architectures={arch!r}: not a DFlash drafter (expected {ARCHITECTURE!r})")
        if d.get("model_type", "qwen3") not in ("qwen3", "llama"):
            raise ValueError(f"model_type={d.get('model_type')!r}: only Qwen3-style drafters are supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r}: only 'silu' is supported")
        if d.get("attention_bias"):
            raise ValueError("attention_bias=true: only bias-free projections are supported")
        dc = d.get("dflash_config") or {}
        extra = [k for k in _UNSUPPORTED_KEYS if dc.get(k)]
        if extra:
            raise ValueError(f"dflash_config has {extra}: DFlash variants with extra modules are not supported")
        if float(dc.get("output_multiplier", 1.0)) != 1.0 or dc.get("final_logit_softcapping"):
            raise ValueError("output_multiplier / final_logit_softcapping are not supported")
        types = d.get("layer_types") or []
        if any(t != "full_attention" for t in types) or d.get("is_causal") or d.get("use_sliding_window"):
            raise ValueError(f"layer_types={types!r}: only non-causal full-attention layers are supported")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope!r} is not supported (only plain RoPE)")

        def get(key, default=None):
            return dc.get(key, d.get(key, default))

        mask = get("mask_token_id")
        if mask is None:
            raise ValueError("no mask_token_id (dflash_config.mask_token_id): this runtime cannot resolve a "
                             "mask token string without the tokenizer")
        ours = d.get("specattn") or {}
        try:
            heads, L = d["num_attention_heads"], d["num_hidden_layers"]
            n = get("num_target_layers")
            taps = get("target_layer_ids")
            if taps is None:
                if n is None:
                    raise ValueError("neither target_layer_ids nor num_target_layers is given")
                taps = context_layer_ids(int(n), int(L))
            return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                       num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
                       head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
                       num_hidden_layers=L, target_layer_ids=list(taps),
                       num_target_layers=None if n is None else int(n), block_size=int(get("block_size", 16)),
                       mask_token_id=mask, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                       max_position_embeddings=d.get("max_position_embeddings", 2048),
                       bos_token_id=d.get("bos_token_id"), eos_token_ids=d.get("eos_token_id"),
                       target_model=ours.get("target_model"), training=ours.get("training") or {})
        except KeyError as e:
            raise ValueError(f"DFlash config is missing {e.args[0]!r}") from None


def checkpoint_nbytes(config: DFlashConfig, bytes_per_element: int = 2) -> int:
    """Tensor bytes of the checkpoint (bf16: 2 per element; the safetensors header adds a few
    KiB, :data:`HEADER_ALLOWANCE` bounds it).  SmolLM2-135M (H 576, 9 / 3 heads of 64), 2
    layers, 3 taps: MLP width 1536 (the target's) 16,153,856 bytes (15.41 MiB); 896:
    11,730,176 bytes (11.19 MiB); z-lab's 5-layer / 5-tap shape at full width: 36.93 MiB."""
    return bytes_per_element * sum(math.prod(s) for s in config.param_shapes().values())


def fit_intermediate_size(config: DFlashConfig, max_bytes: int, multiple: int = 128) -> Optional[int]:
    """The largest MLP width ``<= config.intermediate_size``, a multiple of ``multiple``, whose
    bf16 checkpoint plus :data:`HEADER_ALLOWANCE` fits ``max_bytes``; ``config``'s own width
    when it fits as is; None when not even ``multiple`` fits."""
    if checkpoint_nbytes(config) + HEADER_ALLOWANCE <= max_bytes:
        return config.intermediate_size
    for inter in range(config.intermediate_size // multiple * multiple, 0, -multiple):
        if checkpoint_nbytes(replace(config, intermediate_size=inter)) + HEADER_ALLOWANCE <= max_bytes:
            return inter
    return None


def init_weights(config: DFlashConfig, seed: int = 0, std: float = 0.02, norm_jitter: float = 0.0
                 ) -> Dict[str, torch.Tensor]:
    """Fresh float32 CPU weights under the checkpoint names, deterministic in ``seed``: linears
    ~ N(0, std^2) (HF's ``initializer_range``, what z-lab's ``post_init`` uses), norm weights
    ``1`` (+ ``norm_jitter * N(0, 1)``, for tests that must tell the norms apart)."""
    return random_init(config.param_shapes(), seed, std, norm_jitter)


def _check_weights(config: DFlashConfig, weights: Dict[str, torch.Tensor], source: str) -> None:
    """ValueError unless ``weights`` has exactly the checkpoint's tensors and shapes (a copy
    of the target's ``embed_tokens`` / ``lm_head``, which some trainers save, is ignored)."""
    check_weight_shapes(config.param_shapes(), {n: t for n, t in weights.items()
                                                if not n.endswith(("embed_tokens.weight", "lm_head.weight"))}, source)


def _internal_from_checkpoint(config: DFlashConfig, ck: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Checkpoint names -> the runtime's layout: per-layer ``layers.{i}.{q_proj, q_norm, o_proj,
    gate_proj, up_proj, down_proj, input_layernorm, post_attention_layernorm}.weight``, one
    stacked ``w_kv = [k_0; v_0; k_1; v_1; ...]`` and ``k_norm [L, head_dim]``."""
    w = {n: ck[n] for n in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    ks, vs, kn = [], [], []
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        for ours, theirs in (("input_layernorm", "input_layernorm"), ("post_attention_layernorm",
                                                                      "post_attention_layernorm"),
                             ("q_proj", "self_attn.q_proj"), ("q_norm", "self_attn.q_norm"),
                             ("o_proj", "self_attn.o_proj"), ("gate_proj", "mlp.gate_proj"),
                             ("up_proj", "mlp.up_proj"), ("down_proj", "mlp.down_proj")):
            w[f"{p}{ours}.weight"] = ck[f"{p}{theirs}.weight"]
        ks.append(ck[p + "self_attn.k_proj.weight"])
        vs.append(ck[p + "self_attn.v_proj.weight"])
        kn.append(ck[p + "self_attn.k_norm.weight"])
    w["w_kv"] = ops.stack_kv_proj_weights(ks, vs)
    w["k_norm"] = torch.stack(kn)
    return w


def _checkpoint_from_internal(config: DFlashConfig, w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`_internal_from_checkpoint` (views of ``w``, checkpoint order)."""
    kv = config.num_key_value_heads * config.head_dim
    out = {}
    for name in config.param_shapes():
        if name in w:
            out[name] = w[name]
            continue
        i, rest = name[len("layers."):].split(".", 1)
        i = int(i)
        if rest == "self_attn.k_proj.weight":
            out[name] = w["w_kv"][2 * i * kv:(2 * i + 1) * kv]
        elif rest == "self_attn.v_proj.weight":
            out[name] = w["w_kv"][(2 * i + 1) * kv:(2 * i + 2) * kv]
        elif rest == "self_attn.k_norm.weight":
            out[name] = w["k_norm"][i]
        else:
            out[name] = w[f"layers.{i}.{rest.split('.', 1)[1]}"]       # self_attn.X / mlp.X -> X
    return out


def _check_fits(config: DFlashConfig, target: LlamaModel) -> None:
    """ValueError naming the first field of ``config`` that does not fit ``target``."""
    tc = target.config
    if config.hidden_size != tc.hidden_size:
        raise ValueError(f"drafter hidden_size={config.hidden_size} != target hidden_size={tc.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocab_size={config.vocab_size} != target vocabulary {target.vocab_size}")
    if config.num_target_layers is not None and config.num_target_layers != target.num_layers:
        raise ValueError(f"num_target_layers={config.num_target_layers}: the drafter reads a "
                         f"{config.num_target_layers}-layer target, this one has {target.num_layers} layers")
    if max(config.target_layer_ids) >= target.num_layers:
        raise ValueError(f"target_layer_ids={config.target_layer_ids} outside the target's {target.num_layers} layers")


# ----------------------------------------------------------------------------- drafter

class DFlashDrafter(TargetSharingDrafter):
    """A DFlash block drafter over a :class:`~specattn.spec_runtime.model.LlamaModel` target.

    Per draft layer ``l``: ``input_layernorm``, Q projection + per-head ``q_norm``, K/V
    projection (rows of the stacked ``w_kv``, the layout of :func:`specattn.ops.materialize_kv`)
    + per-head K RMSNorm (``k_norm[l]``), RoPE, attention (through the backend at inference,
    dense in :meth:`dense_forward`), ``o_proj``, ``post_attention_layernorm``, SwiGLU MLP; then
    the final ``norm`` and the target's LM head.  Token ids (the root and
    :attr:`mask_token_id`) embed with the target's table.

    Args:
        target: the target model (its embeddings, LM head and device are shared; never copied).
        num_layers, num_context_layers: draft layers and target taps of a fresh config
            (:meth:`DFlashConfig.from_target`) when ``config`` is None (defaults 2 and 3).
        max_positions: rows of the RoPE cos/sin cache used for the context K (>= the
            engine's ``max_context``; :meth:`reserve_positions` grows it).
        seed: init seed when ``weights`` is None.
        config: :class:`DFlashConfig` (must fit ``target``).
        weights: checkpoint-named tensors (any dtype/device; :meth:`DFlashConfig.param_shapes`),
            or None for a random init (:func:`init_weights`, ``init_std``).
        dtype: the drafter's weights/activations dtype (default the target's; training keeps
            float32 master weights).

    Raises:
        ValueError: a target that is not a ``LlamaModel``, ``num_layers < 1``, a config that
            does not fit the target (hidden size, vocabulary, depth, taps), weights with
            missing / unexpected / misshapen tensors.
    """

    def __init__(self, target: LlamaModel, num_layers: int = 2, num_context_layers: int = 3,
                 max_positions: int = 4096, seed: int = 0, *, config: Optional[DFlashConfig] = None,
                 weights: Optional[Dict[str, torch.Tensor]] = None, dtype: Optional[torch.dtype] = None,
                 init_std: float = 0.02):
        if not isinstance(target, LlamaModel):
            raise ValueError("the DFlash drafter needs a Llama target (spec_runtime.model.LlamaModel)")
        if config is None:
            if num_layers < 1:
                raise ValueError(f"num_layers must be >= 1, got {num_layers}")
            config = DFlashConfig.from_target(target.config, num_layers, num_context_layers,
                                              num_target_layers=target.num_layers)
        _check_fits(config, target)
        self.config, self.target = config, target
        self.device = target.device
        self.dtype = dtype or target.dtype
        self.num_layers = config.num_hidden_layers
        self.context_layers = list(config.target_layer_ids)
        self.mask_token_id = config.mask_token_id
        self.block_size = config.block_size
        if weights is None:
            weights = init_weights(config, seed, init_std)
        _check_weights(config, weights, "weights")
        w = _internal_from_checkpoint(config, weights)
        self.w: Dict[str, torch.Tensor] = {k: t.detach().to(self.device, self.dtype).contiguous()
                                           for k, t in w.items()}
        c = config
        self.layers = [AttentionLayer.mha(i, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
                       for i in range(self.num_layers)]
        self.cos_sin_cache: Optional[torch.Tensor] = None
        self._fused: Optional[Dict[str, object]] = None   # inference weights (reserve_positions)
        self.draft_vocab: Optional[torch.Tensor] = None     # set_draft_vocab: a reduced draft vocabulary
        self._reserve_rope(max_positions)

    # ------------------------------------------------------------------ construction / io
    @classmethod
    def from_target(cls, target: LlamaModel, num_layers: int = 2, num_context_layers: int = 3, *,
                    context_layers: Optional[Sequence[int]] = None, intermediate_size: Optional[int] = None,
                    block_size: int = 16, mask_token_id: Optional[int] = None, seed: int = 0,
                    dtype: Optional[torch.dtype] = None, init_std: float = 0.02,
                    max_positions: Optional[int] = None, target_model: Optional[str] = None) -> "DFlashDrafter":
        """A fresh random drafter for ``target`` (:meth:`DFlashConfig.from_target` over the
        target's ``num_layers``; see there for the arguments).  ``max_positions`` default:
        the target's ``max_position_embeddings`` (at least 4096)."""
        cfg = DFlashConfig.from_target(target.config, num_layers, num_context_layers, context_layers=context_layers,
                                       intermediate_size=intermediate_size, block_size=block_size,
                                       mask_token_id=mask_token_id, num_target_layers=target.num_layers,
                                       target_model=target_model)
        return cls(target, max_positions=max_positions or max(cfg.max_position_embeddings, 4096), seed=seed,
                   config=cfg, dtype=dtype, init_std=init_std)

    @classmethod
    def load(cls, path, target: LlamaModel, *, dtype: Optional[torch.dtype] = None,
             max_positions: Optional[int] = None, draft_vocab_size: Optional[int] = None) -> "DFlashDrafter":
        """Load ``path/config.json`` + ``path/model.safetensors`` (z-lab's layout) for ``target``;
        ``draft_vocab_size``: draft only from that many of the most frequent tokens of
        ``path/token_frequencies.json`` (:meth:`set_draft_vocab`; None or the vocabulary
        size: all).

        Raises:
            FileNotFoundError: missing folder or files (the counts file only with a
                ``draft_vocab_size``).  ValueError: not a DFlash config this runtime runs, a
                checkpoint that does not fit ``target`` (hidden size, vocabulary, target
                depth, tap layers, mask token, tensor names / shapes; the message says
                which), or a bad ``draft_vocab_size``.
        """
        from safetensors.torch import load_file
        path = Path(path)
        cfg_file, w_file = path / CONFIG_FILE, path / WEIGHTS_FILE
        for f in (cfg_file, w_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f} not found (a DFlash drafter folder has {CONFIG_FILE} and {WEIGHTS_FILE})")
        try:
            config = DFlashConfig.from_hf_dict(json.loads(cfg_file.read_text()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{cfg_file}: {e}") from None
        weights = load_file(str(w_file), device="cpu")
        try:
            drafter = cls(target, max_positions=max_positions or max(config.max_position_embeddings, 4096),
                          config=config, weights=weights, dtype=dtype)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        drafter.load_draft_vocab(path, draft_vocab_size)
        return drafter

    def set_draft_vocab(self, token_ids: Optional[torch.Tensor]) -> None:
        """Draft only from ``token_ids`` (int ``[V']``, distinct target token ids; None: the
        full vocabulary again): the block's LM head at inference (:meth:`forward_logits`)
        runs over those rows of the target's head, so its cost shrinks ``V / V'`` times;
        tokens outside are never drafted, which costs acceptance, never correctness (the
        verify is unchanged).  FR-Spec's frequency-ranked draft vocabulary (Zhao et al.,
        arXiv 2502.14856), as for EAGLE-3 (:meth:`Eagle3Drafter.set_draft_vocab`).  Training
        (:meth:`logits`) keeps the full vocabulary.  Set it before building an engine: a
        captured CUDA graph keeps the head it was captured with.

        Raises:
            ValueError: not a 1-D integer tensor, empty, repeated ids, or ids outside
                ``[0, vocab_size)``.
        """
        self.draft_vocab = None if token_ids is None else self._check_draft_vocab(token_ids)
        if self._fused is not None:
            self._fused["head"] = self._folded_head()

    def _folded_head(self) -> torch.Tensor:
        """The inference LM head: the target's (the draft vocabulary's rows of it) with the
        final ``norm`` folded in."""
        head = self.lm_head if self.draft_vocab is None else self.lm_head[self.draft_vocab]
        with torch.no_grad():
            return ops.fold_rms_norm_weight(head.detach().to(self.dtype), self.w["norm.weight"])

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Checkpoint-named tensors (z-lab's names; detached views in the drafter's dtype)."""
        return {k: v.detach() for k, v in _checkpoint_from_internal(self.config, self.w).items()}

    def save(self, path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (bf16, z-lab's names) into folder
        ``path`` (created).  Returns ``Path(path)``."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_hf_dict(), indent=2) + "\n")
        tensors = {k: v.to("cpu", torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path / WEIGHTS_FILE, 0o666 & ~umask)   # the writer may create it 0600
        return path

    def _reserve_rope(self, n: int) -> None:
        if self.cos_sin_cache is None or self.cos_sin_cache.shape[0] < n:
            self.cos_sin_cache = ops.make_cos_sin_cache(max(int(n), 1), self.config.head_dim, self.config.rope_theta,
                                                        device=self.device)

    def reserve_positions(self, n: int) -> None:
        """Make the RoPE table cover positions ``0 .. n-1`` and enable the fused inference
        path of :meth:`forward_logits`: per layer ``cat(q_proj, k_proj, v_proj)`` with
        ``input_layernorm`` folded in (:func:`specattn.ops.fold_rms_norm_weight`; the
        residual GEMM before it hands over the rows' sums of squares) and the gate / up
        projections with ``post_attention_layernorm`` folded in, and the target's LM head
        with the final ``norm`` folded in.  Built from :attr:`w` now: call it again after
        changing the weights.  The engine calls it with its ``max_context``."""
        self._reserve_rope(n)
        w = self.w
        with torch.no_grad():
            qkv, gate_up = [], []
            for i in range(self.num_layers):
                p = f"layers.{i}."
                qkv.append(ops.fold_rms_norm_weight(torch.cat([w[p + "q_proj.weight"], self._w_kv(i)]).detach(),
                                                    w[p + "input_layernorm.weight"]))
                gate_up.append(tuple(ops.fold_rms_norm_weight(w[p + f"{x}_proj.weight"].detach(),
                                                              w[p + "post_attention_layernorm.weight"])
                                     for x in ("gate", "up")))
        self._fused = dict(qkv=qkv, gate_up=gate_up, head=self._folded_head())

    # ------------------------------------------------------------------ model interface

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids (the root and :attr:`mask_token_id`, all in the target's vocabulary) ->
        ``[T, hidden]`` rows of the target's table, in the drafter's dtype (graph-safe)."""
        return self.embed_tokens[input_ids].to(self.dtype)

    def _w_kv(self, i: int) -> torch.Tensor:
        rows = 2 * self.config.num_key_value_heads * self.config.head_dim
        return self.w["w_kv"][i * rows:(i + 1) * rows]

    def _block_qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer ``i`` on block tokens: residual ``h [M, H]`` -> ``q [M, nh, hd]``,
        ``k, v [M, nkv, hd]`` (``input_layernorm``, projections, Q/K norms, RoPE)."""
        c, w, p = self.config, self.w, f"layers.{i}."
        M, eps = h.shape[0], c.rms_norm_eps
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = rms_norm((x @ w[p + "q_proj.weight"].T).view(M, c.num_attention_heads, c.head_dim),
                     w[p + "q_norm.weight"], eps)
        kv = (x @ self._w_kv(i).T).view(M, 2, c.num_key_value_heads, c.head_dim)
        k = rms_norm(kv[:, 0], w["k_norm"][i], eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), kv[:, 1]

    def _tail(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s tail: ``h [M, H]``, attention output ``o [M, nh*hd]`` -> ``h + o Wo^T``,
        then the post-attention norm and SwiGLU MLP with their residual."""
        w, p = self.w, f"layers.{i}."
        h = h + o @ w[p + "o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], self.config.rms_norm_eps)
        return h + (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) \
            @ w[p + "down_proj.weight"].T

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                capture_layers: Sequence[int] = ()):
        """Block forward: ``input_ids [T]`` -> ``(hidden [T, hidden] after the final norm, [])``.
        Which keys each token sees is the batch's (``TARGET_VERIFY`` + all-ones mask: the
        context prefix and the whole block).  Writes the block tokens' K/V at
        ``batch.out_cache_loc``.  ``capture_layers`` is accepted for interface parity only."""
        c = self.config
        T = input_ids.shape[0]
        h = self.embed(input_ids)
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, self.dtype)
        for i, layer in enumerate(self.layers):
            q, k, v = self._block_qkv(i, h, cos, sin)
            o = backend.forward(q, k.contiguous(), v.contiguous(), layer, batch)
            h = self._tail(i, h, o.reshape(T, -1))
        return rms_norm(h, self.w["norm.weight"], c.rms_norm_eps), []

    def forward_logits(self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                       capture_layers: Sequence[int] = (), logit_rows: Optional[torch.Tensor] = None,
                       top_k: Optional[int] = None):
        """The block forward and the LM head: ``(float32 logits [T, V], None)`` (``[R, V]``
        for the int64 rows ``logit_rows [R]``), or with ``top_k`` (at most
        ``ops.TOPK_MAX_K``) ``((values float32 [R, top_k], token ids int64 [R, top_k]), None)``,
        each row's best log-probabilities, the logits never written.  After
        :meth:`reserve_positions` and with frozen weights, each layer is four fused launches
        plus attention (:func:`specattn.ops.qkv_rope_store` with the per-head Q / K norms,
        :func:`~specattn.ops.matmul_residual`, :func:`~specattn.ops.rms_norm_swiglu`,
        :func:`~specattn.ops.matmul_residual`) and the head one
        (:func:`~specattn.ops.rms_norm_matmul` / ``rms_norm_matmul_topk``): the same
        mathematics as :meth:`forward` + :meth:`logits`, rounded differently (float32 inside
        each launch).  Otherwise it is :meth:`forward` + :meth:`logits` (then ``top_k`` is
        computed from the logits).  With a draft vocabulary (:meth:`set_draft_vocab`) the
        logits cover its columns only (``[.., V']``, :meth:`draft_token_ids` maps them) and
        the top-k are over it, as target token ids.  Writes the block's K/V at
        ``batch.out_cache_loc``; ``capture_layers`` is accepted for interface parity only; no
        host sync."""
        f = self._fused
        if f is None or self.w["fc.weight"].requires_grad:
            hidden, _ = self.forward(input_ids, batch, backend)
            logits = self.logits(hidden if logit_rows is None else hidden[logit_rows])
            if self.draft_vocab is not None:
                logits = logits[:, self.draft_vocab]
            if top_k is None:
                return logits, None
            vals, cols = ops.topk_log_probs(logits, top_k)
            return (vals, self.draft_token_ids(cols)), None
        c, w = self.config, self.w
        T, eps, pool = input_ids.shape[0], c.rms_norm_eps, backend.kv_pool
        h = self.embed(input_ids)  # (a new tensor: the residual stream, updated in place)
        ss = None  # the rows' sums of squares of h, from the residual GEMM that wrote it
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            q = ops.qkv_rope_store(h, None, f["qkv"][i], eps, batch.positions, self.cos_sin_cache,
                                   batch.out_cache_loc, pool.get_key_buffer(i), pool.get_value_buffer(i),
                                   c.num_attention_heads, c.num_key_value_heads, c.head_dim, row_sumsq=ss,
                                   q_norm_weight=w[p + "q_norm.weight"], k_norm_weight=w["k_norm"][i],
                                   check_values=False, **dict(zip(("k_scale", "v_scale"), pool.kv_scales(i))))
            o = backend.forward(q, None, None, layer, batch, save_kv_cache=False)
            _, ss = ops.matmul_residual(o.reshape(T, -1), w[p + "o_proj.weight"], h, return_row_sumsq=True)
            act = ops.rms_norm_swiglu(h, None, *f["gate_up"][i], eps, row_sumsq=ss)
            _, ss = ops.matmul_residual(act, w[p + "down_proj.weight"], h, return_row_sumsq=True)
        if logit_rows is not None:
            h, ss = h[logit_rows], None
        if top_k is not None:
            return ops.rms_norm_matmul_topk(h, None, f["head"], eps, top_k, row_sumsq=ss,
                                            column_ids=self.draft_vocab), None
        return ops.rms_norm_matmul(h, None, f["head"], eps, out_dtype=torch.float32, row_sumsq=ss), None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` (normed) -> float32 logits ``[T, V]`` through the target's LM head."""
        return (hidden.to(self.lm_head.dtype) @ self.lm_head.T).float()

    # ------------------------------------------------------------------ context KV
    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., taps * hidden]`` concatenated target hidden states -> ``hidden_norm(fc(.))``
        ``[..., hidden]`` in the drafter's dtype."""
        return rms_norm(features.to(self.dtype) @ self.w["fc.weight"].T, self.w["hidden_norm.weight"],
                        self.config.rms_norm_eps)

    def write_context_kv(self, features: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                         pool) -> None:
        """Materialize every draft layer's context K/V for ``T`` committed tokens (features
        ``[T, taps * hidden]``, RoPE ``positions [T]``, slots ``loc [T]``) into ``pool``: one
        ``fc`` GEMM + one fused :func:`specattn.ops.materialize_kv` for all layers, whose
        GEMM prologue applies ``hidden_norm`` (:meth:`context_hidden`'s mathematics)."""
        ops.materialize_kv(features.to(self.dtype) @ self.w["fc.weight"].T, self.w["w_kv"], self.w["k_norm"],
                           positions, self.cos_sin_cache, loc, pool.k_buffer, pool.v_buffer,
                           eps=self.config.rms_norm_eps, hidden_norm_weight=self.w["hidden_norm.weight"],
                           check_values=False,  # our own slots
                           **dict(zip(("k_scale", "v_scale"), pool.kv_scales(0))))

    # ------------------------------------------------------------------ training (dense)
    def dense_forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      anchors: torch.Tensor, segments: Optional[torch.Tensor] = None,
                      keep: Optional[torch.Tensor] = None, block_size: Optional[int] = None) -> torch.Tensor:
        """Blocks at sampled anchors of packed rows, differentiable in the drafter's weights
        only (the target's embedding and LM head, and ``features``, get no gradient).

        Block ``n`` of row ``b`` (anchor ``a = anchors[b, n]``, a row index) holds
        ``[tokens[b, a], MASK x (S-1)]`` at RoPE positions ``positions[b, a] + 0 .. S-1``; its
        queries see the context keys of row indices ``j < a`` of the same sequence (built from
        ``hidden_norm(fc(features[b, j]))`` at ``positions[b, j]``, as
        :meth:`write_context_kv` stores them) and the keys of their own block, all at once
        (one softmax, non-causal); never another block, never the anchor's own context
        feature.  This is exactly the inference block forward with context ``0 .. a-1``
        (tested against the backend forward).  Attention runs in float32 (as the backends
        accumulate), also under bf16 autocast.

        Args:
            tokens: int64 ``[B, T]`` token ids (several sequences may be packed per row).
            features: ``[B, T, taps * H]`` target features (the tap layers concatenated).
            positions: int64 ``[B, T]``: each token's position in its own sequence.
            anchors: int64 ``[B, N]`` row indices of the blocks' roots.
            segments: int64 ``[B, T]`` sequence id per token (``-1`` = padding); context never
                crosses sequences.  None: one sequence per row.
            keep: bool ``[B, N]``: False marks padding blocks (they see only their own
                block; their output is garbage the caller masks).  None: all kept.
            block_size: ``S`` (default the config's).

        Returns:
            ``[B, N, S, H]`` hidden states after the final norm (logits: :meth:`logits`);
            position ``k >= 1`` of a block drafts the token at ``a + k``.

        Raises:
            ValueError: inconsistent shapes, anchors outside ``[0, T)``, ``block_size < 2``.
        """
        c, w = self.config, self.w
        B, T = tokens.shape
        S = int(block_size or c.block_size)
        F_ = c.num_context_features * c.hidden_size
        if features.shape != (B, T, F_) or positions.shape != (B, T) or anchors.dim() != 2 \
                or anchors.shape[0] != B:
            raise ValueError(f"need tokens/positions [B, T], features [B, T, {F_}], anchors [B, N]; got "
                             f"{tuple(tokens.shape)}, {tuple(positions.shape)}, {tuple(features.shape)}, "
                             f"{tuple(anchors.shape)}")
        N = anchors.shape[1]
        if segments is not None and segments.shape != (B, T):
            raise ValueError(f"segments must be [B, T] = {(B, T)}, got {tuple(segments.shape)}")
        if keep is not None and keep.shape != (B, N):
            raise ValueError(f"keep must be [B, N] = {(B, N)}, got {tuple(keep.shape)}")
        if S < 2:
            raise ValueError(f"block_size must be >= 2, got {S}")
        if N and (int(anchors.min()) < 0 or int(anchors.max()) >= T):
            raise ValueError(f"anchors must be row indices in [0, {T})")
        dev, L = tokens.device, self.num_layers
        nkv, hd, eps = c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        anchors = anchors.long()
        ids = torch.full((B, N, S), self.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = tokens.gather(1, anchors)
        bpos = positions.gather(1, anchors)[:, :, None] + torch.arange(S, device=dev)
        h = self.embed(ids.reshape(-1))                                               # [B*N*S, H]
        ctx = self.context_hidden(features.reshape(B * T, F_))                        # [B*T, H]
        kv_ctx = (ctx @ w["w_kv"].T).view(B * T, L, 2, nkv, hd)                        # all layers: one GEMM
        cos_b, sin_b = rope_cos_sin(bpos.reshape(-1), hd, c.rope_theta, h.dtype)
        cos_c, sin_c = rope_cos_sin(positions.reshape(-1), hd, c.rope_theta, h.dtype)
        vis = torch.arange(T, device=dev)[None, None, :] < anchors[:, :, None]        # [B, N, T]
        if segments is not None:
            vis = vis & (segments[:, None, :] == segments.gather(1, anchors)[:, :, None])
        if keep is not None:
            vis = vis & keep[:, :, None]
        for i in range(L):
            q, kb, vb = self._block_qkv(i, h, cos_b, sin_b)
            kc = apply_rope(rms_norm(kv_ctx[:, i, 0], w["k_norm"][i], eps), cos_c, sin_c)
            o = _block_attention(q, kb, vb, kc, kv_ctx[:, i, 1], vis, B, N, S, T, nkv)
            h = self._tail(i, h, o)
        return rms_norm(h, w["norm.weight"], eps).view(B, N, S, -1)


def _block_attention(q, kb, vb, kc, vc, vis, B: int, N: int, S: int, T: int, nkv: int) -> torch.Tensor:
    """Dense block attention in float32: queries ``q [B*N*S, nh, hd]`` against the visible
    context keys ``kc, vc [B*T, nkv, hd]`` (``vis [B, N, T]``) and their own block's keys
    ``kb, vb [B*N*S, nkv, hd]``, one softmax over both; GQA: query head ``h`` reads KV head
    ``h // (nh / nkv)``.  Returns ``[B*N*S, nh*hd]`` in ``q``'s dtype."""
    nh, hd = q.shape[1], q.shape[2]
    G, scale = nh // nkv, hd ** -0.5
    with torch.autocast(q.device.type, enabled=False):
        qf = q.float().view(B, N, S, nkv, G, hd).permute(0, 3, 4, 1, 2, 5)          # [B, nkv, G, N, S, hd]
        kbf = kb.float().view(B, N, S, nkv, hd).permute(0, 3, 1, 2, 4)[:, :, None]   # [B, nkv, 1, N, S, hd]
        vbf = vb.float().view(B, N, S, nkv, hd).permute(0, 3, 1, 2, 4)[:, :, None]
        kcf = kc.float().view(B, T, nkv, hd).permute(0, 2, 1, 3)[:, :, None]          # [B, nkv, 1, T, hd]
        vcf = vc.float().view(B, T, nkv, hd).permute(0, 2, 1, 3)[:, :, None]
        s_ctx = (qf.reshape(B, nkv, G, N * S, hd) @ kcf.transpose(-1, -2)).view(B, nkv, G, N, S, T)
        s_ctx = s_ctx.masked_fill(~vis[:, None, None, :, None, :], float("-inf"))
        s_blk = qf @ kbf.transpose(-1, -2)                                            # [B, nkv, G, N, S, S]
        p = torch.softmax(torch.cat([s_ctx, s_blk], -1) * scale, dim=-1)
        o = (p[..., :T].reshape(B, nkv, G, N * S, T) @ vcf).view(B, nkv, G, N, S, hd) + p[..., T:] @ vbf
    return o.to(q.dtype).permute(0, 3, 4, 1, 2, 5).reshape(B * N * S, nh * hd)


# ---------------------------------------------------------------------- round pieces
def chain_tree(P: torch.Tensor, D: int) -> ops.TreeInfo:
    """The verify tree of a chain ``root -> d_1 -> .. -> d_{D-1}`` for ``bs`` requests with
    prefixes ``P [bs]``: lower-triangular mask, positions ``P + j``, ``retrive_index = b*D + j``,
    ``next_token = j + 1`` (``-1`` at the end), no siblings.  Equal to ``ops.build_tree`` with
    ``topk = 1, num_steps = D - 1``, ``parent_list = [-1, 0, .., D-3]``,
    ``selected_index = [0 .. D-2]``, built without its host loop."""
    bs, dev = P.shape[0], P.device
    j = torch.arange(D, device=dev)
    mask = pack_tree_mask((j[None, :] <= j[:, None]).expand(bs, D, D).contiguous())
    nxt = torch.where(j + 1 < D, j + 1, -1).expand(bs, D).contiguous()
    return ops.TreeInfo(mask, (P.long()[:, None] + j).flatten(),
                        torch.arange(bs * D, device=dev).view(bs, D), nxt,
                        torch.full((bs, D), -1, dtype=torch.int64, device=dev))


class DFlashStrategy(Strategy):
    """DFlash block drafting (steps 1-6 of the module docstring), over the engine's public
    operations.  The drafter is a random-init :class:`DFlashDrafter` of
    ``spec.draft_layers`` (default 2) layers.  ``spec.topk = 1`` verifies the block's argmax
    chain; ``topk > 1`` verifies a DDTree of ``spec.num_draft_tokens`` nodes grown from the
    block's per-position top-k (:func:`specattn.ops.ddtree_candidates`)."""

    name = "dflash"
    draft_topk = None    # the block forward is a TARGET_VERIFY with an all-ones mask

    def __init__(self, spec: SpecConfig, target, max_context: int = 4096, draft_model=None):
        self.spec, self.K = spec, spec.topk
        # the largest block (buffers, graph state); a round's own: block_for
        self.B = max([spec.block_size] + [b for _, b in spec.block_size_by_batch])
        self.D = self.B if self.K == 1 else spec.max_num_draft_tokens()   # the largest; a round's own: tree_for
        self.verify_topk = self.K         # 1: the target verifies a chain
        if draft_model is not None:       # a trained drafter (DFlashDrafter.load)
            if not isinstance(draft_model, DFlashDrafter):
                raise ValueError(f"algo dflash needs a DFlashDrafter as draft_model, got {type(draft_model).__name__}")
            self.drafter = draft_model
        else:
            self.drafter = DFlashDrafter(target, 2 if spec.draft_layers is None else spec.draft_layers,
                                         max_positions=max_context)
        check_draft_vocab_topk(self.drafter, self.K)
        self.drafter.reserve_positions(max_context)   # the RoPE table and the fused inference path
        self.target_capture_layers = tuple(self.drafter.context_layers)
        self.tokens_per_round = max(self.B, self.D)
        self.emit_width = self.D

    def round_modes(self):
        return [("target", ForwardMode.TARGET_VERIFY), ("draft", ForwardMode.TARGET_VERIFY)]

    def block_for(self, eng: "Engine", bs: int) -> int:
        """The block of a round over ``bs`` request rows: ``spec.block_size_for`` of the
        batch as the engine pads it for its graphs (so eager and replayed rounds agree)."""
        if not self.spec.block_size_by_batch:
            return self.spec.block_size
        return self.spec.block_size_for(self.padded_rows(eng, bs))

    def tree_for(self, eng: "Engine", bs: int) -> int:
        """The tokens a round over ``bs`` request rows verifies: the chain's block (or its
        first ``spec.num_draft_tokens_for`` the padded batch), or the DDTree's
        ``spec.num_draft_tokens_for`` the padded batch."""
        if not self.spec.num_draft_tokens_by_batch:
            return self.block_for(eng, bs) if self.K == 1 else self.D
        return self.spec.num_draft_tokens_for(self.padded_rows(eng, bs))

    def graph_state_sizes(self, max_batch: int) -> Dict[str, Tuple[int, int]]:
        return {"target": (max_batch, max_batch * self.D), "draft": (max_batch, max_batch * self.B)}

    def per_mode_graph_plan(self, eng: "Engine") -> list:
        if self.spec.block_size_by_batch:   # a per-mode graph has one block: the block forward runs eagerly
            return []
        return [("draft", self.drafter, eng.draft_backend, ForwardMode.TARGET_VERIFY, self.B, eng.max_batch)]

    def prefill(self, eng: "Engine", pb: "PrefillBatch") -> None:
        """The prompt's drafter context KV from the tap layers of the target's prefill
        (same slots and positions as the target's)."""
        self.drafter.write_context_kv(pb.out.features, pb.batch.positions, pb.batch.out_cache_loc, eng.draft_pool)

    def block_inputs(self, eng: "Engine", rows: torch.Tensor) -> ops.ExtendCacheLocs:
        """The block's inputs for request ``rows``, in one launch (:func:`ops.extend_cache_locs`):
        the prefix lengths ``P`` (int32 ``[bs]``), positions ``P .. P+B-1`` and KV slots
        ``req_to_token[row, P:P+B]`` (int64 ``[bs * B]`` each, request-major) and the input
        ids ``[root, MASK x (B-1)]`` (int64 ``[bs, B]``); ``B``: :meth:`block_for`."""
        return ops.extend_cache_locs(rows, eng.prefix_lens, eng.req_pool.req_to_token,
                                     self.block_for(eng, rows.shape[0]), roots=eng.roots,
                                     fill_id=self.drafter.mask_token_id, check_values=False)

    def block_top(self, eng: "Engine", rb: "RoundBatch", rows: torch.Tensor, k: int,
                  block: Optional[ops.ExtendCacheLocs] = None,
                  n_out: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One non-causal drafter forward per request over ``[root, MASK x (B-1)]`` at positions
        ``P .. P+B-1`` (``TARGET_VERIFY``, all-ones tree mask; slots ``req_to_token[row, P:P+B]``;
        ``block``: :meth:`block_inputs` when the caller has them).  Returns the block's input
        ids ``[bs, B]`` and the ``k`` best ``(log-probabilities float32, token ids int64)``,
        each ``[bs, n_out - 1, k]``, of the drafts at block positions ``1 .. n_out-1``
        (``n_out``: default ``B``; the LM head runs on those rows only, and where the drafter
        has a fused one the logits are never written)."""
        bs, n = rows.shape[0], eng.max_batch + 1
        B = self.block_for(eng, bs)
        n_out = B if n_out is None else n_out
        block = self.block_inputs(eng, rows) if block is None else block
        ids = block.input_ids
        ones = eng.constant(("dflash_ones_mask", B, n),   # packed all-ones [B, B]: non-causal in the block
                            lambda: pack_tree_mask(torch.ones(n, B, B, dtype=torch.bool, device=eng.device)))[:bs]
        batch = eng.batch(ForwardMode.TARGET_VERIFY, rows, block.seq_lens, B, block.out_cache_loc,
                          positions=block.positions, tree_mask=ones, host_prefix_lens=rb.host())
        if n_out == B:   # every row (the root's row is one wasted head row: cheaper than a gather)
            out = eng.forward("draft", ids.flatten(), batch, top_k=k)
            vals, toks = out.top if out.top is not None else ops.topk_log_probs(out.logits, k)
            return ids, vals.view(bs, B, k)[:, 1:], toks.view(bs, B, k)[:, 1:]
        head_rows = eng.constant(("dflash_head_rows", B, n_out, n), lambda: (   # b * B + j, 1 <= j < n_out
            torch.arange(n, device=eng.device)[:, None] * B + torch.arange(1, n_out, device=eng.device)).flatten())
        out = eng.forward("draft", ids.flatten(), batch, top_k=k, logit_rows=head_rows[:bs * (n_out - 1)])
        vals, toks = out.top if out.top is not None else ops.topk_log_probs(out.logits, k)
        return ids, vals.view(bs, n_out - 1, k), toks.view(bs, n_out - 1, k)

    def propose_block(self, eng: "Engine", rb: "RoundBatch", rows: torch.Tensor,
                      block: Optional[ops.ExtendCacheLocs] = None,
                      n_out: Optional[int] = None) -> torch.Tensor:
        """The chain's ``draft_tokens [bs, n_out]`` (default ``[bs, B]``): the roots, then the
        block's argmax drafts (``block``, ``n_out``: as :meth:`block_top`)."""
        ids, _, toks = self.block_top(eng, rb, rows, 1, block, n_out)
        return torch.cat([ids[:, :1], toks[..., 0]], dim=1)

    def _tree(self, eng: "Engine", rb: "RoundBatch", rows: torch.Tensor, D: int):
        """``(P int32 [bs], draft_tokens [bs, D], TreeInfo, num_steps, (positions,
        out_cache_loc))`` of this round's chain or DDTree (``D``: :meth:`tree_for`; the last
        pair: int64 ``[bs * D]`` each, the verify's positions and slots, ``P + j`` and
        ``req_to_token[row, P + j]``, also the committed tokens' positions)."""
        block = self.block_inputs(eng, rows)
        P = block.seq_lens
        if self.K == 1:   # chain_tree(P, D): kept rows sliced
            bs, n = rows.shape[0], eng.max_batch + 1
            c = eng.constant(("dflash_chain_tree", D, n),
                             lambda: chain_tree(torch.zeros(n, dtype=torch.int64, device=eng.device), D))
            slots = self._verify_slots(eng, rows, block, D)
            tree = ops.TreeInfo(c.tree_mask[:bs], slots[0], c.retrive_index[:bs], c.retrive_next_token[:bs],
                                c.retrive_next_sibling[:bs])
            return P, self.propose_block(eng, rb, rows, block, D), tree, D - 1, slots
        ids, vals, toks = self.block_top(eng, rb, rows, self.K, block)
        decay, S = self.spec.ddtree_depth_decay, vals.shape[1]
        weights = None if decay == 1.0 else eng.constant(   # position k's log-probabilities weigh decay ** (k - 1)
            ("ddtree_depth_weights", S, decay),
            lambda: torch.pow(decay, torch.arange(S, dtype=vals.dtype, device=eng.device)))
        parent_list, scores, tokens = ops.ddtree_candidates(vals, toks, depth_weights=weights)
        roots = ids[:, 0]
        if scores.shape[1] <= ops.EAGLE_MAX_CANDIDATES:   # one launch: the D - 1 best, in order
            selected, draft_tokens = ops.select_draft_tokens(scores, tokens, roots, D)
        else:
            selected = ops.order_keys(scores).topk(D - 1, dim=-1).indices.sort(dim=-1).values   # the fused order
            draft_tokens = torch.cat([roots[:, None], tokens.gather(1, selected)], 1)
        tree = ops.build_tree(parent_list, selected, P, self.K, self.B - 1, D)
        return P, draft_tokens, tree, self.B - 1, self._verify_slots(eng, rows, block, D)

    def _verify_slots(self, eng: "Engine", rows: torch.Tensor, block: ops.ExtendCacheLocs,
                      D: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The verify's positions and slots of ``D`` tokens per request (int64 ``[bs * D]``
        each): the block's when ``D`` is its size, else one more :func:`ops.extend_cache_locs`."""
        if D != self.block_for(eng, rows.shape[0]):
            block = ops.extend_cache_locs(rows, eng.prefix_lens, eng.req_pool.req_to_token, D, check_values=False)
        return block.positions, block.out_cache_loc

    def round(self, eng: "Engine", rb: "RoundBatch") -> None:
        rows = rb.rows
        bs = rows.shape[0]
        D = self.tree_for(eng, bs)
        P, draft_tokens, tree, num_steps, (positions, out_cache_loc) = self._tree(eng, rb, rows, D)
        batch = eng.batch(ForwardMode.TARGET_VERIFY, rows, P, D, out_cache_loc, positions=tree.positions,
                          tree_mask=tree.tree_mask, host_prefix_lens=rb.host())
        t = eng.forward("target", draft_tokens.flatten(), batch, capture_layers=self.target_capture_layers,
                        top_k=eng.greedy_top_k)
        cp, n_acc = eng.verify_and_compact(draft_tokens, tree, t, num_steps, out_cache_loc,
                                           hidden_states=t.features, chain=self.K == 1)
        # context KV of root + accepted drafts, compacted to rows 0 .. a (positions P .. P+a);
        # the other rows land past the new prefix and are rewritten before any read
        self.drafter.write_context_kv(cp.hidden_states, positions, cp.tgt_loc, eng.draft_pool)
        eng.commit(rb, rows, P, cp.predicts.view(bs, D), n_acc)
