"""What every drafter that borrows its target's embedding and LM head has in common (the
EAGLE-3 and DFlash drafters): the shared tables, its own KV pool, its trainable tensors, and
a frequency-ranked draft vocabulary (FR-Spec) read from the token counts beside a checkpoint."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

__all__ = ["TargetSharingDrafter", "random_init", "frequent_tokens", "read_token_counts", "TOKEN_FREQUENCIES_FILE",
           "DEFAULT_DRAFT_VOCAB", "default_draft_vocab_size", "target_mismatch"]

#: per-token counts of the training data's generated tokens (JSON ``{"vocab_size", "counts"}``),
#: beside the checkpoint: the frequency ranking of a draft vocabulary (engines ignore it)
TOKEN_FREQUENCIES_FILE = "token_frequencies.json"
#: the draft vocabulary the project's commands use for a drafter folder that ships token counts
#: (:func:`default_draft_vocab_size`): for SmolLM2 the 16,384 most frequent of 49,152 tokens
#: cover 98.8 % of the target's generated tokens, and each draft LM head reads a third
DEFAULT_DRAFT_VOCAB = 16384


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


def frequent_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` most frequent token ids by ``counts`` (``[V]``, a count per token id), most
    frequent first, ties (and never-seen ids) to the lower id: the draft vocabulary a drafter's
    ``set_draft_vocab`` takes (FR-Spec ranks by frequency in a corpus; here the target's own
    generated tokens, ``TOKEN_FREQUENCIES_FILE`` of a trained drafter).

    Raises:
        ValueError: ``counts`` not 1-D or ``n`` outside ``[1, len(counts)]``.
    """
    counts = torch.as_tensor(counts)
    if counts.dim() != 1 or not 1 <= int(n) <= counts.numel():
        raise ValueError(f"need 1-D counts and 1 <= n <= {counts.numel()}, got {tuple(counts.shape)}, n={n}")
    return torch.argsort(-counts.to(torch.int64).cpu(), stable=True)[:int(n)].clone()


def target_mismatch(config: dict, target) -> Optional[Tuple[str, object, object]]:
    """The first target size a drafter's ``config.json`` dict records that ``target`` (a
    :class:`~.loader.LlamaConfig`) does not have, as ``(key, recorded, target's)``, or None:
    hidden size, vocabulary, heads, KV heads and the target's layer count (an EAGLE-3
    config's ``specattn.target_num_layers``, a DFlash config's ``num_target_layers``).  A
    size the config does not record is not compared."""
    layers = config.get("num_target_layers", (config.get("specattn") or {}).get("target_num_layers"))
    for key, mine in (("hidden_size", config.get("hidden_size")), ("vocab_size", config.get("vocab_size")),
                      ("num_attention_heads", config.get("num_attention_heads")),
                      ("num_key_value_heads", config.get("num_key_value_heads")), ("num_hidden_layers", layers)):
        want = getattr(target, key, None)
        if mine is not None and mine != want:
            return key, mine, want
    return None


def default_draft_vocab_size(path) -> Optional[int]:
    """The draft vocabulary size the project's commands pick when none is given for the
    drafter folder ``path`` (EAGLE-3 or DFlash): :data:`DEFAULT_DRAFT_VOCAB` when the folder
    holds ``TOKEN_FREQUENCIES_FILE`` over a larger vocabulary, else None (the full
    vocabulary).  Never raises: a malformed counts file is reported when it is loaded."""
    f = Path(path) / TOKEN_FREQUENCIES_FILE
    if not f.is_file():
        return None
    try:
        vocab = int(json.loads(f.read_text()).get("vocab_size", 0))
    except (ValueError, TypeError, AttributeError):
        return None
    return DEFAULT_DRAFT_VOCAB if vocab > DEFAULT_DRAFT_VOCAB else None


def read_token_counts(path) -> torch.Tensor:
    """int64 ``[V]`` token counts from a drafter folder's ``TOKEN_FREQUENCIES_FILE``.

    Raises:
        FileNotFoundError: the file is missing.  ValueError: it is malformed.
    """
    f = Path(path) / TOKEN_FREQUENCIES_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found (written by `specattn drafter train`; a draft "
                                f"vocabulary needs the target's token counts)")
    try:
        d = json.loads(f.read_text())
        counts = torch.tensor(d["counts"], dtype=torch.int64)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{f}: not a token-count file ({e})") from None
    if counts.dim() != 1 or counts.numel() != d.get("vocab_size") or bool((counts < 0).any()):
        raise ValueError(f"{f}: counts must be {d.get('vocab_size')} non-negative integers")
    return counts


class TargetSharingDrafter:
    """Base of drafters over a :class:`~specattn.spec_runtime.model.LlamaModel` target that
    own only their layers (:attr:`w`) and read the target's embedding table and LM head.

    Subclasses set ``target``, ``config`` (``hidden_size``, ``num_key_value_heads``,
    ``head_dim``), ``num_layers``, ``device``, ``dtype``, ``w`` and ``draft_vocab`` (None or
    the int64 ids their ``set_draft_vocab`` keeps)."""

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

    # ------------------------------------------------------------------ draft vocabulary
    def _check_draft_vocab(self, token_ids) -> torch.Tensor:
        """``token_ids`` validated for :meth:`set_draft_vocab`: int64 on :attr:`device`.

        Raises:
            ValueError: not a 1-D integer tensor, empty, repeated ids, or ids outside
                ``[0, vocab_size)``.
        """
        ids = torch.as_tensor(token_ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be a non-empty 1-D integer tensor, got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        ids = ids.to(torch.int64).cpu()
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token_ids must lie in [0, {self.vocab_size}), got [{int(ids.min())}, "
                             f"{int(ids.max())}]")
        if ids.unique().numel() != ids.numel():
            raise ValueError("token_ids holds repeated ids")
        return ids.to(self.device)

    def draft_token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Target token ids of logits ``columns`` (int64, any shape): ``draft_vocab[columns]``
        with a draft vocabulary, else ``columns`` itself."""
        return columns if self.draft_vocab is None else self.draft_vocab[columns]

    def load_draft_vocab(self, path, draft_vocab_size: Optional[int]) -> None:
        """Draft from the ``draft_vocab_size`` most frequent tokens of the drafter folder
        ``path``'s ``TOKEN_FREQUENCIES_FILE`` (:meth:`set_draft_vocab`); None or the
        vocabulary size: the full vocabulary (nothing read).

        Raises:
            FileNotFoundError: no counts file.  ValueError: counts over another vocabulary,
                or ``draft_vocab_size`` outside ``[1, vocab_size]``.
        """
        if draft_vocab_size is None or draft_vocab_size == self.vocab_size:
            return
        counts = read_token_counts(path)
        if counts.numel() != self.vocab_size:
            raise ValueError(f"{path}: token counts cover {counts.numel()} ids, the target has {self.vocab_size}")
        self.set_draft_vocab(frequent_tokens(counts, draft_vocab_size))
