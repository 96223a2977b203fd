"""What every drafter that borrows its target's embedding and LM head has in common (the
EAGLE-3 and DFlash drafters): the shared tables, its own KV pool, and its trainable tensors."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

__all__ = ["TargetSharingDrafter", "random_init"]


def random_init(param_shapes: Dict[str, Tuple[int, ...]], seed: int = 0, std: float = 0.02,
                norm_jitter: float = 0.0) -> Dict[str, torch.Tensor]:
    """Fresh float32 CPU tensors for ``{name: shape}``, deterministic in ``seed`` (drawn in
    ``param_shapes``' order): matrices ~ N(0, std^2) (HF's ``initializer_range``), vectors
    (norm weights) ``1`` (+ ``norm_jitter * N(0, 1)``, for tests that must tell the norms
    apart)."""
    g = torch.Generator().manual_seed(int(seed))
    out = {}
    for name, shape in param_shapes.items():
        if len(shape) == 1:
            out[name] = 1.0 + norm_jitter * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) * std
    return out


class TargetSharingDrafter:
    """Base of drafters over a :class:`~specattn.spec_runtime.model.LlamaModel` target that
    own only their layers (:attr:`w`) and read the target's embedding table and LM head.

    Subclasses set ``target``, ``config`` (``hidden_size``, ``num_key_value_heads``,
    ``head_dim``), ``num_layers``, ``device``, ``dtype`` and ``w``."""

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def embed_tokens(self) -> torch.Tensor:
        """The target's embedding table ``[V, H]`` (shared)."""
        return self.target.w["model.embed_tokens.weight"]

    @property
    def lm_head(self) -> torch.Tensor:
        """The target's LM head ``[V, H]`` (shared; the tied embedding for SmolLM2)."""
        return self.target.lm_head

    def make_kv_pool(self, size: int, page_size: int = 1):
        """The drafter's KV pool: ``num_layers`` layers of its KV heads / head_dim, in
        :attr:`dtype` on :attr:`device` (``size`` slots + the reserved page)."""
        from specattn.backends import MHATokenToKVPool
        c = self.config
        return MHATokenToKVPool(size, page_size, self.dtype, c.num_key_value_heads, c.head_dim,
                                self.num_layers, self.device)

    def trainable_parameters(self) -> Dict[str, torch.Tensor]:
        """The drafter's own tensors with ``requires_grad`` on (the target's embedding and LM
        head stay frozen).  They are :attr:`w`'s tensors: an optimizer over them trains the
        drafter in place."""
        for t in self.w.values():
            t.requires_grad_(True)
        return dict(self.w)
