"""DFlash speculative decoding in the reference runtime: a small non-causal *block* drafter
that reads the target's hidden states, and lossless verification of its block as a chain.

What DFlash is (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding", served by
SGLang as ``--speculative-algorithm DFLASH``; facts from the z-lab reference model and the
SGLang worker, no code taken from either)
---------------------------------------------------------------------------------------
- The drafter is a few transformer layers of the target's width (Qwen3-style: per-head Q and
  K RMSNorm, RoPE) that shares the target's token embeddings and LM head.
- Context: the target's residual stream after a few chosen layers (one tap: the middle
  layer; several: evenly spaced over layers ``1 .. n-3``) is concatenated per token,
  projected by ``fc`` and normalized (``hidden_norm``).  That *context hidden* feeds the K/V
  projections of every draft layer (K then gets the layer's K RMSNorm and RoPE at the token's
  position); the drafter never runs queries for context tokens.  SGLang keeps these K/V in a
  draft KV cache and appends the newly committed tokens' K/V after every verify
  (``_append_target_hidden_to_draft_kv``), fused across layers when it can
  (``FusedKVMaterializeHelper``) -- here: :func:`specattn.ops.materialize_kv`.
- Drafting is ONE forward over a block of ``B`` positions ``P .. P+B-1``: position ``P``
  holds the last verified token (the *root*, known), the others the embedding of a mask
  token; attention is non-causal inside the block and sees all the context.  The outputs at
  block positions ``1 .. B-1`` give the ``B-1`` draft tokens (argmax), the token AT that
  position (not after it).  The block's own K/V are scratch: SGLang allocates their slots for
  the draft forward and drops them afterwards.
- Verification: root + ``B-1`` drafts form a chain of ``D = B`` tokens, verified by the target
  in one forward (greedy: longest prefix of drafts equal to the target's argmax); the target's
  hidden states of the accepted tokens become the next context.

Our simplifications: the drafter is random-initialised (no trained DFlash checkpoint exists
for our models, so acceptance is ~0 on real text: reported, not hidden); the mask token is a
drafter-owned embedding row (id ``vocab_size``, one past the target's vocabulary) instead of
an added ``<|MASK|>`` token; the number of context taps is independent of the drafter's depth
(DFlash's default ties them); bias-free projections.

How it maps onto our modes and pools (one round per running batch)
------------------------------------------------------------------
Per request ``P`` = target KV committed (= drafter context KV committed: both cover positions
``0 .. P-1``), ``root`` = last emitted token, no KV anywhere yet.  Target and drafter pools
use the same slot indices, reserved per request row by the engine.

1. slots: the round works at positions ``P .. P+B-1`` (``req_to_token[row, P : P+B]``);
2. draft (:meth:`DFlashStrategy.propose_block`): the drafter runs ``TARGET_VERIFY`` on its own backend/pool
   with ``seq_lens = P``, ``D = B`` tokens ``[root, MASK x (B-1)]`` at positions
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

from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from specattn import ops
from specattn.backends import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode, pack_tree_mask

from .model import LlamaModel, apply_rope, rms_norm, rope_cos_sin
from .strategies import SpecConfig, Strategy

if TYPE_CHECKING:  # the engine imports this module
    from .engine import Engine, ForwardOut, RoundBatch

__all__ = ["context_layer_ids", "DFlashDrafter", "chain_tree", "DFlashStrategy"]


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


class DFlashDrafter:
    """A DFlash-style block drafter over a :class:`~specattn.spec_runtime.model.LlamaModel`
    target (random init, deterministic in ``seed``).

    Per draft layer ``l``: ``input_layernorm``, Q projection + per-head ``q_norm``, K/V
    projection (rows of the stacked ``w_kv``, the layout of :func:`specattn.ops.materialize_kv`)
    + per-head K RMSNorm (``k_norm[l]``), RoPE, attention through the backend, ``o_proj``,
    ``post_attention_layernorm``, SwiGLU MLP; then the final ``norm`` and the target's LM head.
    Token ids ``< vocab_size`` embed with the target's table, :attr:`mask_token_id`
    (``= vocab_size``) with the drafter's ``mask_embedding``.

    Args:
        target: the target model (its config, embeddings, LM head, device, dtype are shared).
        num_layers: draft layers (DFlash drafters have a few; default 2).
        num_context_layers: target tap layers (:func:`context_layer_ids`; default 3).
        max_positions: rows of the RoPE cos/sin cache used for the context K (>= the
            engine's ``max_context``).
        seed: weight init seed.
    """

    def __init__(self, target: LlamaModel, num_layers: int = 2, num_context_layers: int = 3,
                 max_positions: int = 4096, seed: int = 0):
        if not isinstance(target, LlamaModel):
            raise ValueError("the DFlash drafter needs a Llama target (spec_runtime.model.LlamaModel)")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        c = target.config
        self.config, self.target = c, target
        self.device, self.dtype = target.device, target.dtype
        self.num_layers = num_layers
        self.context_layers = context_layer_ids(target.num_layers, num_context_layers)
        self.mask_token_id = target.vocab_size
        h, H, Hkv, Dh, I = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                            c.head_dim, c.intermediate_size)
        g = torch.Generator().manual_seed(int(seed))

        def lin(out_f, in_f):  # N(0, 1/in): keeps the residual stream's scale
            return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

        w: Dict[str, torch.Tensor] = {"fc.weight": lin(h, len(self.context_layers) * h),
                                      "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
        k_w, v_w, k_norm = [], [], []
        for i in range(num_layers):
            p = f"layers.{i}."
            w[p + "input_layernorm.weight"] = torch.ones(h)
            w[p + "post_attention_layernorm.weight"] = torch.ones(h)
            w[p + "q_proj.weight"] = lin(H * Dh, h)
            w[p + "q_norm.weight"] = torch.ones(Dh)
            w[p + "o_proj.weight"] = lin(h, H * Dh)
            w[p + "gate_proj.weight"], w[p + "up_proj.weight"] = lin(I, h), lin(I, h)
            w[p + "down_proj.weight"] = lin(h, I)
            k_w.append(lin(Hkv * Dh, h))
            v_w.append(lin(Hkv * Dh, h))
            k_norm.append(torch.ones(Dh))
        # ONE stacked K|V projection for all layers: materialize_kv's single GEMM for context
        # tokens, and (per-layer row slices) the block tokens' K/V in forward().
        w["w_kv"] = ops.stack_kv_proj_weights(k_w, v_w)
        w["k_norm"] = torch.stack(k_norm)
        emb = target.w["model.embed_tokens.weight"]
        w["mask_embedding"] = torch.randn(h, generator=g) * emb.float().std().cpu()
        self.w = {k: t.to(self.device, self.dtype).contiguous() for k, t in w.items()}
        self.layers = [AttentionLayer.mha(i, H, Hkv, Dh) for i in range(num_layers)]
        self.cos_sin_cache = ops.make_cos_sin_cache(max_positions, Dh, c.rope_theta, device=self.device)

    # ------------------------------------------------------------------ model interface
    def make_kv_pool(self, size: int, page_size: int = 1):
        """The drafter's KV pool: ``num_layers`` layers of the target's KV head shape."""
        from specattn.backends import MHATokenToKVPool
        c = self.config
        return MHATokenToKVPool(size, page_size, self.dtype, c.num_key_value_heads, c.head_dim,
                                self.num_layers, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids (target vocab or :attr:`mask_token_id`) -> ``[T, hidden]`` (graph-safe)."""
        table = self.target.w["model.embed_tokens.weight"]
        e = table[input_ids.clamp(max=self.mask_token_id - 1)]
        return torch.where((input_ids == self.mask_token_id)[:, None], self.w["mask_embedding"], e)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                capture_layers: Sequence[int] = ()):
        """Block forward: ``input_ids [T]`` -> ``(hidden [T, hidden] after the final norm, [])``.
        Which keys each token sees is the batch's (``TARGET_VERIFY`` + all-ones mask: the
        context prefix and the whole block).  Writes the block tokens' K/V at
        ``batch.out_cache_loc``.  ``capture_layers`` is accepted for interface parity only."""
        c, w = self.config, self.w
        T, Hkv, Dh, eps = input_ids.shape[0], c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        kv_rows = 2 * Hkv * Dh
        h = self.embed(input_ids)
        cos, sin = rope_cos_sin(batch.positions, Dh, c.rope_theta, self.dtype)
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
            q = rms_norm((x @ w[p + "q_proj.weight"].T).view(T, c.num_attention_heads, Dh),
                         w[p + "q_norm.weight"], eps)
            kv = (x @ w["w_kv"][i * kv_rows:(i + 1) * kv_rows].T).view(T, 2, Hkv, Dh)
            k, v = rms_norm(kv[:, 0], w["k_norm"][i], eps), kv[:, 1]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = backend.forward(q, k.contiguous(), v.contiguous(), layer, batch)
            h = h + o.reshape(T, -1) @ w[p + "o_proj.weight"].T
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
            h = h + (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) \
                @ w[p + "down_proj.weight"].T
        return rms_norm(h, w["norm.weight"], eps), []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head (shared)."""
        return self.target.logits(hidden)

    # ------------------------------------------------------------------ context KV
    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """``[T, taps * hidden]`` concatenated target hidden states -> ``hidden_norm(fc(.))``."""
        return rms_norm(features @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.config.rms_norm_eps)

    def write_context_kv(self, features: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                         pool) -> None:
        """Materialize every draft layer's context K/V for ``T`` committed tokens (features
        ``[T, taps * hidden]``, RoPE ``positions [T]``, slots ``loc [T]``) into ``pool``: one
        ``fc`` GEMM + one fused :func:`specattn.ops.materialize_kv` for all layers."""
        ops.materialize_kv(self.context_hidden(features), self.w["w_kv"], self.w["k_norm"], positions,
                           self.cos_sin_cache, loc, pool.k_buffer, pool.v_buffer,
                           eps=self.config.rms_norm_eps, check_values=False)  # our own slots


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
    ``spec.draft_layers`` (default 2) layers."""

    name = "dflash"
    verify_topk = 1      # the target verifies a chain
    draft_topk = None    # the block forward is a TARGET_VERIFY with an all-ones mask

    def __init__(self, spec: SpecConfig, target, max_context: int = 4096):
        self.B = spec.block_size
        self.drafter = DFlashDrafter(target, spec.draft_layers or 2, max_positions=max_context)
        self.target_capture_layers = tuple(self.drafter.context_layers)
        self.tokens_per_round = self.emit_width = self.B

    def round_modes(self):
        return [("target", ForwardMode.TARGET_VERIFY), ("draft", ForwardMode.TARGET_VERIFY)]

    def graph_state_sizes(self, max_batch: int) -> Dict[str, Tuple[int, int]]:
        return {"target": (max_batch, max_batch * self.B), "draft": (max_batch, max_batch * self.B)}

    def per_mode_graph_plan(self, eng: "Engine") -> list:
        return [("draft", self.drafter, eng.draft_backend, ForwardMode.TARGET_VERIFY, self.B, eng.max_batch)]

    def prefill(self, eng: "Engine", rows: torch.Tensor, lens: List[int], ids: torch.Tensor,
                batch: ForwardBatch, out: "ForwardOut") -> None:
        """The prompt's drafter context KV from the tap layers of the target's prefill
        (same slots and positions as the target's)."""
        self.drafter.write_context_kv(out.features, batch.positions, batch.out_cache_loc, eng.draft_pool)

    def propose_block(self, eng: "Engine", rb: "RoundBatch", rows: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
        """One non-causal drafter forward per request over ``[root, MASK x (B-1)]`` at positions
        ``P .. P+B-1`` (``TARGET_VERIFY``, all-ones tree mask; slots ``req_to_token[row, P:P+B]``).
        Returns ``draft_tokens [bs, B]``: the roots, then the argmax drafts."""
        B, bs, dev = self.B, rows.shape[0], eng.device
        roots = eng.roots[rows]
        ids = torch.full((bs, B), self.drafter.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = roots
        cols = P[:, None] + torch.arange(B, device=dev)
        loc = eng.req_pool.req_to_token[rows[:, None], cols].long().flatten()
        ones = pack_tree_mask(torch.ones(bs, B, B, dtype=torch.bool, device=dev))
        batch = eng.batch(ForwardMode.TARGET_VERIFY, rows, P, B, loc, positions=cols.flatten(),
                          tree_mask=ones, host_prefix_lens=rb.host())
        logits = eng.forward("draft", ids.flatten(), batch).logits.view(bs, B, -1)
        return torch.cat([roots[:, None], logits[:, 1:].argmax(-1)], dim=1)

    def round(self, eng: "Engine", rb: "RoundBatch") -> None:
        B, rows, dev = self.B, rb.rows, eng.device
        bs = rows.shape[0]
        P = eng.prefix_lens[rows]
        draft_tokens = self.propose_block(eng, rb, rows, P)                 # [bs, B], root first
        tree = chain_tree(P, B)
        out_cache_loc = eng.req_pool.req_to_token[rows[:, None], P[:, None] + torch.arange(B, device=dev)
                                                  ].long().flatten()
        batch = eng.batch(ForwardMode.TARGET_VERIFY, rows, P, B, out_cache_loc, positions=tree.positions,
                          tree_mask=tree.tree_mask, host_prefix_lens=rb.host())
        t = eng.forward("target", draft_tokens.flatten(), batch, capture_layers=self.target_capture_layers)
        cp, n_acc = eng.verify_and_compact(draft_tokens, tree, t.logits, B - 1, out_cache_loc,
                                           hidden_states=t.features)
        # context KV of root + accepted drafts (positions P .. P+a); the other rows land past
        # the new prefix and are overwritten by the next block forward before any read
        self.drafter.write_context_kv(cp.hidden_states, tree.positions, cp.tgt_loc, eng.draft_pool)
        eng.commit(rb, rows, P, cp.predicts.view(bs, B).long(), n_acc)
