"""Triton kernels (``specattn.triton_kernels``).

- :mod:`.tree_ops`: EAGLE tree build, greedy tree verify and accepted-path compaction, one
  launch each for the whole batch, registered as the ``triton`` implementations of
  :mod:`specattn.ops` (tests run them under ``TRITON_INTERPRET=1`` on CPU).
"""
