"""specattn: attention kernels and backends for speculative decoding.

Subpackages: ``specattn.backends`` (the AttentionBackend contract, pools, backends),
``specattn.ops`` (spec-decoding ops with CUDA / Triton / reference implementations),
``specattn.triton_kernels``, ``specattn.spec_runtime``, ``specattn.bench``.
"""
__version__ = "0.1.0"
