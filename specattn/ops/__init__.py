"""Spec-decoding ops behind one registry (see :mod:`specattn.ops.registry`).

Each public function validates its inputs, then runs the CUDA, Triton or reference
implementation (``impl=`` forces one).
"""
from . import registry
from .kv_move import move_kv_cache, move_kv_cache_reference

__all__ = ["registry", "move_kv_cache", "move_kv_cache_reference"]
