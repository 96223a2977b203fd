"""Spec-decoding ops behind one registry (see :mod:`specattn.ops.registry`).

Each public function validates its inputs, then runs the CUDA, Triton or reference
implementation (``impl=`` forces one):

- :func:`build_tree`: EAGLE top-k drafts -> tree mask, positions, ``retrive_*`` (and
  FlashInfer's packed custom mask on request, :func:`flashinfer_mask_bytes`);
- :func:`verify_tree_greedy`, :func:`tree_speculative_sampling`: tree verification;
- :func:`compact_accepted_path`: accepted path to the front of each block + KV move pairs;
- :func:`move_kv_cache`: KV slot moves for all layers at once;
- :func:`materialize_kv`: DFlash drafter KV from target hidden states;
- :func:`topk_log_probs`: per-row top-k log-probabilities (and argmax) of logits;
- :func:`rms_norm_matmul`, :func:`qkv_rope_store`, :func:`matmul_residual`,
  :func:`rms_norm_swiglu`: a Llama layer's GEMMs with the norm, RoPE + KV store, residual
  and SwiGLU fused in; :func:`rms_norm_matmul_topk`: the LM head's top-k without the logits;
- :func:`ngram_candidates`: n-gram drafts from each request's own history;
- :func:`ddtree_candidates`: a DDTree's candidate nodes from a block drafter's per-position top-k;
- :func:`eagle_beam_step`, :func:`select_draft_tokens`: an EAGLE draft step's candidates and
  next beams, and the draft tree's tokens from all candidates;
- :func:`fork_req_to_token_rows`: the ``req_to_token`` rows of beams drafted on scratch rows;
- :func:`gather_rows`, :func:`scatter_rows`: per-request state read / written by request row,
  several tensors per launch; :func:`extend_cache_locs`: a round's positions and KV slots;
  :func:`commit_accepted`: a round's emitted tokens, new roots and prefix lengths.
"""
from . import registry
from .compaction import CompactedPath, compact_accepted_path, compact_accepted_path_reference
from .ddtree import MAX_TOPK as DDTREE_MAX_TOPK
from .ddtree import ddtree_candidates, ddtree_candidates_reference
from .eagle_draft import MAX_CANDIDATES as EAGLE_MAX_CANDIDATES
from .eagle_draft import MAX_TOPK as EAGLE_MAX_TOPK
from .eagle_draft import (BeamStep, eagle_beam_step, eagle_beam_step_reference,
                          fork_req_to_token_rows, fork_req_to_token_rows_reference, select_draft_tokens,
                          select_draft_tokens_reference)
from .fused_llama import (llama_rms_norm_reference, matmul_residual, matmul_residual_reference,
                          qkv_rope_store, qkv_rope_store_reference, rms_norm_matmul,
                          rms_norm_matmul_reference, rms_norm_matmul_topk, rms_norm_matmul_topk_reference,
                          rms_norm_swiglu, rms_norm_swiglu_reference,
                          fold_rms_norm_weight)
from .kv_materialize import (apply_rope_neox_reference, make_cos_sin_cache, materialize_kv,
                             materialize_kv_reference, rms_norm_reference, stack_kv_proj_weights)
from .kv_move import move_kv_cache, move_kv_cache_reference
from .ngram import MAX_NGRAM_SIZE as NGRAM_MAX_SIZE, MAX_STEPS as NGRAM_MAX_STEPS, MAX_TOPK as NGRAM_MAX_TOPK
from .ngram import ngram_candidates, ngram_candidates_reference
from .rows import (MAX_ROW_TENSORS, ExtendCacheLocs, commit_accepted, commit_accepted_reference,
                   extend_cache_locs, extend_cache_locs_reference, gather_rows, gather_rows_reference,
                   scatter_rows, scatter_rows_reference)
from .topk import MAX_K as TOPK_MAX_K, order_keys, topk_log_probs, topk_log_probs_reference
from .tree import (TreeInfo, build_tree, build_tree_reference, flashinfer_mask_bytes,
                   num_tree_candidates)
from .verify import (VerifyResult, tree_speculative_sampling, tree_speculative_sampling_reference,
                     verify_tree_greedy, verify_tree_greedy_reference)

__all__ = ["registry", "move_kv_cache", "move_kv_cache_reference", "order_keys",
           "TreeInfo", "build_tree", "build_tree_reference", "num_tree_candidates",
           "flashinfer_mask_bytes",
           "VerifyResult", "verify_tree_greedy", "verify_tree_greedy_reference",
           "tree_speculative_sampling", "tree_speculative_sampling_reference",
           "CompactedPath", "compact_accepted_path", "compact_accepted_path_reference",
           "materialize_kv", "materialize_kv_reference", "make_cos_sin_cache",
           "rms_norm_reference", "apply_rope_neox_reference", "stack_kv_proj_weights",
           "rms_norm_matmul", "rms_norm_matmul_reference", "rms_norm_matmul_topk",
           "rms_norm_matmul_topk_reference", "qkv_rope_store",
           "qkv_rope_store_reference", "matmul_residual", "matmul_residual_reference",
           "rms_norm_swiglu", "rms_norm_swiglu_reference", "llama_rms_norm_reference", "fold_rms_norm_weight",
           "topk_log_probs", "topk_log_probs_reference", "TOPK_MAX_K", "ngram_candidates",
           "ngram_candidates_reference", "NGRAM_MAX_SIZE", "NGRAM_MAX_TOPK", "NGRAM_MAX_STEPS",
           "BeamStep", "eagle_beam_step", "eagle_beam_step_reference",
           "select_draft_tokens", "select_draft_tokens_reference", "fork_req_to_token_rows",
           "fork_req_to_token_rows_reference", "EAGLE_MAX_TOPK",
           "EAGLE_MAX_CANDIDATES", "gather_rows", "gather_rows_reference", "scatter_rows",
           "scatter_rows_reference", "MAX_ROW_TENSORS", "ExtendCacheLocs", "extend_cache_locs",
           "extend_cache_locs_reference", "commit_accepted", "commit_accepted_reference", "ddtree_candidates",
           "ddtree_candidates_reference", "DDTREE_MAX_TOPK"]
