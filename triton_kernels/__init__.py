"""Triton kernels (``specattn.triton_kernels``).

- :mod:`.tree_ops`: EAGLE tree build, greedy tree verify and accepted-path compaction, one
  launch each for the whole batch, registered as the ``triton`` implementations of
  :mod:`specattn.ops` (tests run them under ``TRITON_INTERPRET=1`` on CPU).
- :mod:`.tree_sampling`: stochastic tree verify (speculative sampling along the tree, final
  draw over the vocabulary in tiles), one launch, one program per request.
- :mod:`.kv_materialize`: DFlash fused KV materialization epilogue (K RMSNorm + RoPE, cast,
  store into every draft layer's cache) after one torch GEMM, one launch.
- :mod:`.fused_llama`: the fused Llama-layer GEMMs (RMSNorm prologue; store, residual-add or
  SwiGLU epilogue; QKV + RoPE + KV-cache store), one launch per op, registered as the
  ``triton`` implementations of :mod:`specattn.ops.fused_llama`.
- :mod:`.attention`: paged MHA/GQA attention for every forward mode (causal or bit-packed tree
  mask, GQA rows packed, optional split-KV + merge), used by ``TritonBackend``.
- :mod:`.attention_mla`: the same for absorbed MLA (latent ``kv_lora_rank + qk_rope_head_dim``
  read once per tile for scores and values; heads packed into rows), used by ``TritonBackend``.
"""
