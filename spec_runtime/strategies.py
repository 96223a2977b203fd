"""Decoding algorithms as strategies over the engine's public operations.

A :class:`Strategy` says which forward modes it needs, prefills its drafter after the
target's prefill, and runs one *round* for a batch of requests through
:class:`~specattn.spec_runtime.engine.Engine`'s public operations (``batch``, ``forward``,
``sample``, ``verify_and_compact``, ``commit``).  A round is device work only (no host sync,
no value-dependent shape), so the engine can capture it whole in one CUDA graph.  The engine
never branches on the algorithm: a new drafter (n-gram, DDTree) is a new strategy.

- :class:`PlainDecoding` (``algo="none"``): one target DECODE per round.
- :class:`EagleStrategy` (``algo="eagle"``): EAGLE top-k tree (``topk = 1``: a chain) drafted
  by a self-speculative drafter (the target's first layers, or another Llama), or by an
  EAGLE-3 drafter fed the target's hidden states
  (:class:`~specattn.spec_runtime.eagle3.Eagle3Drafter`).
- :class:`~specattn.spec_runtime.dflash.DFlashStrategy` (``algo="dflash"``): a block drafted
  in one non-causal forward, verified as a chain.

Request state on the device: ``engine.prefix_lens[row]`` (``P``: target KV committed),
``engine.roots[row]`` (the last emitted token, whose target KV is not written yet, at
position ``P``); a strategy adds its own (e.g. EAGLE: the drafter's top-k after the root).
"""
from __future__ import annotations

import math
import numbers

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from specattn import ops
from specattn.backends import ForwardBatch, ForwardMode

from .graph_runner import padded_sizes
from .sampling import top_log_probs

if TYPE_CHECKING:  # the engine imports this module
    from .engine import Engine, ForwardOut, RoundBatch

__all__ = ["SpecConfig", "Strategy", "PrefillBatch", "PlainDecoding", "EagleStrategy", "make_strategy",
           "top_log_probs", "parse_by_batch", "check_draft_vocab_topk"]

Role = str
ModeList = List[Tuple[Role, ForwardMode]]


@dataclass
class SpecConfig:
    """``algo``: ``none`` | ``eagle`` | ``dflash`` | ``ngram``.  EAGLE drafts ``num_steps``
    levels with ``topk`` beams and verifies ``num_draft_tokens`` tokens (root included);
    ``topk = 1`` is a chain.  The self-speculative EAGLE drafter is the target's first
    ``draft_layers`` layers + final norm + LM head (``None``: three quarters of the target's
    layers); a trained EAGLE-3 drafter is passed to the engine as ``draft_model``.  DFlash
    drafts ``block_size - 1`` tokens per round in one non-causal block forward of a
    ``draft_layers``-layer drafter (``None``: 2) and verifies them as a chain, or with
    ``topk > 1`` as a DDTree of ``num_draft_tokens`` nodes.  N-gram drafting copies ``topk``
    chains of ``num_steps`` tokens from the request's own history, matching suffixes of up
    to ``ngram_size`` tokens (:mod:`.ngram`).

    Shapes by batch size: ``(min_batch, value)`` pairs, ``min_batch`` increasing from 2; a
    round over at least ``min_batch`` request rows (counted as the engine pads a batch for
    its graphs: ``graph_runner.padded_sizes``, so eager and replayed rounds agree) takes
    ``value`` instead of the base setting.  The verify's tokens are nearly free at batch 1
    and what a large batch pays for (docs/runtime.md).

    - ``block_size_by_batch``: the DFlash chain's block (``algo="dflash"``, ``topk = 1``);
    - ``num_draft_tokens_by_batch``: the verified tree's tokens of EAGLE (any ``topk``) and
      of a DDTree (``algo="dflash"``, ``topk > 1``); ``topk`` and ``num_steps`` (EAGLE) or
      ``block_size`` (DDTree) stay, so only the kept candidates change.  A DFlash chain
      (``topk = 1``) verifies its whole block without an entry, and with one the first
      ``value`` tokens of it (root included; at most the round's block): the drafter still
      runs the block it was trained on, the verify pays for fewer tokens.  N-gram drafting
      verifies ``1 + topk * num_steps`` tokens; its values ``1 + c * num_steps`` keep ``c``
      (``0 <= c <= topk``) of its chains, the best matches (``c = 0``: the root alone,
      speculation off from that batch size).

    ``ddtree_depth_decay`` (DDTree only, ``> 0``): block position ``k``'s log-probabilities
    weigh ``ddtree_depth_decay ** (k - 1)`` in a candidate's summed score.  The block
    predicts every position alone, so a path's product of marginals underrates a deep draft
    whose ancestors were accepted; below 1 ranks deeper nodes higher while every node still
    scores at most its parent, so the kept nodes keep their ancestors.  The default 0.8: the
    shipped DFlash drafter, topk 8, 32 tokens, CPU float32 exact greedy, 2.99 tokens per
    verify at 1.0 and 3.02 at 0.8 on the 64 eval prompts (the first 16: 2.97 at 1.0, 3.00 /
    3.02 / 3.02 / 2.94 / 2.86 at 0.9 / 0.8 / 0.7 / 0.6 / 0.5, 2.95 at 1.1), and on two
    other sets of 24 chat prompts 3.06 -> 3.09 and 3.03 -> 3.07.  The weights ride in
    :func:`specattn.ops.ddtree_candidates`' launch (``depth_weights``)."""

    algo: str = "none"
    topk: int = 1
    num_steps: int = 3
    num_draft_tokens: int = 4
    draft_layers: Optional[int] = None
    block_size: int = 16
    ngram_size: int = 4
    block_size_by_batch: Tuple[Tuple[int, int], ...] = ()
    num_draft_tokens_by_batch: Tuple[Tuple[int, int], ...] = ()
    ddtree_depth_decay: float = 0.8

    @staticmethod
    def _for(base: int, pairs: Sequence[Tuple[int, int]], batch_rows: int) -> int:
        out = base
        for min_batch, value in pairs:
            if batch_rows >= min_batch:
                out = value
        return out

    def block_size_for(self, batch_rows: int) -> int:
        """The DFlash block of a round over ``batch_rows`` (padded) request rows."""
        return self._for(self.block_size, self.block_size_by_batch, batch_rows)

    def base_num_draft_tokens(self) -> int:
        """The verified tree's tokens (root included) without a batch-size entry:
        ``num_draft_tokens``, or n-gram drafting's ``1 + topk * num_steps``."""
        return 1 + self.topk * self.num_steps if self.algo == "ngram" else self.num_draft_tokens

    def num_draft_tokens_for(self, batch_rows: int) -> int:
        """The verified tree's tokens (root included) of a round over ``batch_rows`` (padded)
        request rows; a DFlash chain's: its verified chain (the block, or the entry's value
        when smaller)."""
        if self.algo == "dflash" and self.topk == 1:
            block = self.block_size_for(batch_rows)
            return min(block, self._for(block, self.num_draft_tokens_by_batch, batch_rows))
        return self._for(self.base_num_draft_tokens(), self.num_draft_tokens_by_batch, batch_rows)

    def max_num_draft_tokens(self) -> int:
        """The largest tree any batch size verifies."""
        return max([self.base_num_draft_tokens()] + [d for _, d in self.num_draft_tokens_by_batch])

    def tokens_per_round(self) -> int:
        """Most token positions past ``P`` one round writes (what a request's context must
        leave room for): the verified tokens, or the DFlash block when larger."""
        if self.algo == "dflash":
            blocks = [self.block_size] + [b for _, b in self.block_size_by_batch]
            return max(*blocks, self.max_num_draft_tokens() if self.topk > 1 else 0)
        if self.algo == "ngram":
            return self.max_num_draft_tokens()
        if self.algo == "eagle":
            return max(self.max_num_draft_tokens(), self.num_steps + 1)
        return 1

    def _check_tree_tokens(self, d: int, what: str) -> None:
        """``d`` verified tokens fit the candidates of this EAGLE tree or DDTree."""
        if self.algo == "dflash":
            n_cand = ops.num_tree_candidates(self.topk, self.block_size - 1)
            whose = f"dflash trees (DDTree) with topk={self.topk}, block_size={self.block_size} need"
        else:
            n_cand = ops.num_tree_candidates(self.topk, self.num_steps)
            whose = f"eagle with topk={self.topk}, num_steps={self.num_steps} needs"
        if not 2 <= d <= n_cand + 1:
            raise ValueError(f"{whose} 2 <= {what} <= {n_cand + 1}, got {d}")

    @staticmethod
    def _check_pairs(name: str, what: str, pairs) -> None:
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in p) for p in pairs):
            raise ValueError(f"{name} must hold (min_batch, {what}) int pairs, got {pairs!r}")
        mins = [m for m, _ in pairs]
        if mins[0] < 2 or any(b <= a for a, b in zip(mins, mins[1:])):
            raise ValueError(f"{name}'s min_batch values must increase from >= 2, got {mins}")

    def validate(self) -> None:
        """Raises TypeError on a size that is not an int (bools are not; never truncated) or
        a ``ddtree_depth_decay`` that is not a real number; ValueError on an unknown algo, a
        ``draft_layers`` below 1 (``None`` is the default) or bounds that no tree can meet.
        The sizes of another algorithm are type-checked only (``topk`` and ``num_steps``
        mean nothing to ``none``, ``num_draft_tokens`` nothing to a DFlash chain)."""
        if self.algo not in ("none", "eagle", "dflash", "ngram"):
            raise ValueError(f"unknown algo {self.algo!r} (none | eagle | dflash | ngram)")
        for name in ("topk", "num_steps", "num_draft_tokens", "block_size", "ngram_size") + (
                ("draft_layers",) if self.draft_layers is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers must be >= 1 (None: the default), got {self.draft_layers}")
        d = self.ddtree_depth_decay
        if isinstance(d, bool) or not isinstance(d, numbers.Real):
            raise TypeError(f"ddtree_depth_decay must be a real number, got {d!r}")
        if self.algo == "ngram" and not (1 <= self.topk <= ops.NGRAM_MAX_TOPK
                                         and 1 <= self.num_steps <= ops.NGRAM_MAX_STEPS
                                         and 1 <= self.ngram_size <= ops.NGRAM_MAX_SIZE):
            raise ValueError(f"ngram needs topk in [1, {ops.NGRAM_MAX_TOPK}] (chains), num_steps in "
                             f"[1, {ops.NGRAM_MAX_STEPS}] (drafts per chain) and ngram_size in "
                             f"[1, {ops.NGRAM_MAX_SIZE}], got {self.topk}, {self.num_steps}, {self.ngram_size}")
        if self.algo == "dflash" and self.topk < 1:
            raise ValueError(f"dflash needs topk >= 1 (1: the block as a chain, > 1: a DDTree), got {self.topk}")
        if self.algo == "dflash" and self.topk > 1:
            if self.topk > ops.DDTREE_MAX_TOPK:
                raise ValueError(f"dflash trees (DDTree) take topk <= {ops.DDTREE_MAX_TOPK}, got {self.topk}")
            self._check_tree_tokens(self.num_draft_tokens, "num_draft_tokens")
        if self.algo == "eagle":
            if self.topk < 1 or self.num_steps < 1:
                raise ValueError(f"eagle needs topk >= 1 and num_steps >= 1, got topk={self.topk}, "
                                 f"num_steps={self.num_steps}")
            self._check_tree_tokens(self.num_draft_tokens, "num_draft_tokens")
        if not (self.ddtree_depth_decay > 0 and math.isfinite(self.ddtree_depth_decay)):
            raise ValueError(f"ddtree_depth_decay must be a finite number > 0, got {self.ddtree_depth_decay!r}")
        if self.algo == "dflash" and self.block_size < 2:
            raise ValueError(f"dflash needs block_size >= 2, got {self.block_size}")
        if self.block_size_by_batch:
            if self.algo != "dflash" or self.topk != 1:
                raise ValueError("block_size_by_batch applies to DFlash chains (algo dflash, topk 1), got "
                                 f"algo {self.algo!r}, topk {self.topk}")
            self._check_pairs("block_size_by_batch", "block_size", self.block_size_by_batch)
            if any(b < 2 for _, b in self.block_size_by_batch):
                raise ValueError(f"block_size_by_batch's blocks must be >= 2, "
                                 f"got {[b for _, b in self.block_size_by_batch]}")
        if self.num_draft_tokens_by_batch:
            if self.algo not in ("eagle", "ngram", "dflash"):
                raise ValueError("num_draft_tokens_by_batch applies to EAGLE, n-gram and DFlash, got algo "
                                 f"{self.algo!r}")
            self._check_pairs("num_draft_tokens_by_batch", "num_draft_tokens", self.num_draft_tokens_by_batch)
            for _, d in self.num_draft_tokens_by_batch:
                if self.algo == "dflash" and self.topk == 1:
                    if d < 2:
                        raise ValueError(f"a DFlash chain's num_draft_tokens_by_batch values (verified tokens, "
                                         f"root included) must be >= 2, got {d}")
                elif self.algo != "ngram":
                    self._check_tree_tokens(d, "num_draft_tokens_by_batch's values")
                elif d < 1 or (d - 1) % self.num_steps or (d - 1) // self.num_steps > self.topk:
                    raise ValueError(f"ngram's num_draft_tokens_by_batch values are 1 + chains * num_steps with "
                                     f"0 <= chains <= topk={self.topk}, num_steps={self.num_steps}, got {d}")


def check_draft_vocab_topk(drafter, topk: int) -> None:
    """Raises ValueError when ``drafter`` drafts from fewer than ``topk`` tokens (its draft
    vocabulary, ``draft_vocab`` int64 ``[V']``, or else its whole ``vocab_size``): a round
    could not draft ``topk`` distinct tokens per position."""
    vocab = getattr(drafter, "draft_vocab", None)
    if vocab is not None and vocab.numel() < topk:
        raise ValueError(f"topk={topk} exceeds the drafter's {vocab.numel()}-token draft vocabulary")
    size = getattr(drafter, "vocab_size", None)
    if vocab is None and isinstance(size, int) and size < topk:
        raise ValueError(f"topk={topk} exceeds the {size}-token vocabulary")


def parse_by_batch(text: str) -> Tuple[Tuple[int, int], ...]:
    """``"16:4,64:2"`` -> ``((16, 4), (64, 2))``: the CLIs' form of
    :attr:`SpecConfig.block_size_by_batch` and :attr:`SpecConfig.num_draft_tokens_by_batch`
    (``""`` -> ``()``).

    Raises:
        ValueError: an entry that is not ``MIN_BATCH:VALUE`` with integers."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            a, b = part.split(":")
            out.append((int(a), int(b)))
        except ValueError:
            raise ValueError(f"expected MIN_BATCH:VALUE entries separated by commas (e.g. 16:4,64:2), "
                             f"got {text!r}") from None
    return tuple(out)


class _RoundRows(NamedTuple):
    """An EAGLE round's per-request state at its rows (:meth:`EagleStrategy._row_state`)."""

    P: torch.Tensor
    roots: torch.Tensor
    top_scores: torch.Tensor
    top_tokens: torch.Tensor
    hidden: Optional[torch.Tensor] = None
    scratch_rows: Optional[torch.Tensor] = None
    scratch_units: Optional[torch.Tensor] = None


@dataclass
class PrefillBatch:
    """What :meth:`Strategy.prefill` gets after the target's EXTEND over the prompts and the
    roots' sampling.  Inside a prefill CUDA graph the shapes are the graph's padded ones:
    padding requests point at the engine's dummy row with no tokens, and padding tokens
    (past every request's) belong to no request (slot 0, position 0, token id 0).

    Attributes:
        rows: int64 ``[bs]`` request rows.
        ids: int64 ``[T]`` the prompts' tokens, request after request.
        batch: the target's EXTEND :class:`~specattn.backends.ForwardBatch` (prefix 0).
        out: the target's :class:`~specattn.spec_runtime.engine.ForwardOut`: ``logits`` of
            the ``last`` rows only (``[bs, V]``), ``features [T, *]`` of every token.
        last: int64 ``[bs]``: each request's last prompt token in ``ids`` (a padding
            request's: a padding token).
        token_rows: int64 ``[T]``: each token's request row.
        lens: the prompt lengths on the host; None inside a graph (device work only then).
    """

    rows: torch.Tensor
    ids: torch.Tensor
    batch: ForwardBatch
    out: "ForwardOut"
    last: torch.Tensor
    token_rows: torch.Tensor
    lens: Optional[List[int]] = None


class Strategy(ABC):
    """One decoding algorithm (see the module docstring).

    Attributes (set by subclasses):
        drafter: the draft model, or None.
        verify_topk, draft_topk: the ``topk`` promise each role's backend is built with
            (1: the target only ever verifies chains).
        tokens_per_round: most positions past ``P`` one round writes or commits.
        emit_width: most tokens one round emits per request.
        records_accept_length: whether rounds are verifies (accept lengths are reported).
        target_capture_layers: target layers whose output residual stream the strategy reads.
        graph_prefill: whether :meth:`prefill` is device work of static shapes that never
            reads ``PrefillBatch.lens`` (the engine may then capture the whole prefill in a
            CUDA graph).
    """

    name = "base"
    drafter = None
    verify_topk: Optional[int] = 1
    draft_topk: Optional[int] = None
    tokens_per_round = 1
    emit_width = 1
    records_accept_length = True
    target_capture_layers: Sequence[int] = ()
    graph_prefill = True

    def required_modes(self) -> ModeList:
        """Every ``(role, mode)`` it runs: the target's EXTEND (prefill), the drafter's
        prefill modes and :meth:`round_modes`."""
        return [("target", ForwardMode.EXTEND)] + self.round_modes()

    @abstractmethod
    def round_modes(self) -> ModeList:
        """The ``(role, mode)`` pairs one round runs."""

    def scratch_shape(self) -> Tuple[int, int]:
        """``(scratch req_to_token rows, scratch pages)`` the engine reserves per request."""
        return 0, 0

    def build(self, eng: "Engine") -> None:
        """Allocate the strategy's device state (one row per engine request row + dummy)."""

    def row_state(self) -> List[torch.Tensor]:
        """The strategy's contiguous per-request-row state tensors ``[rows, ...]`` (built by
        :meth:`build`), whose dummy row the engine zeroes after each round."""
        return []

    @abstractmethod
    def graph_state_sizes(self, max_batch: int) -> Dict[Role, Tuple[int, int]]:
        """``{role: (max requests, max tokens)}`` of one forward in a round of ``max_batch``
        requests (each backend's CUDA-graph state)."""

    def per_mode_graph_plan(self, eng: "Engine") -> list:
        """``(role, model, backend, mode, tokens per request, max requests)`` of the plain
        forwards (token ids in, logits out) that host-planned backends capture per mode."""
        return []

    def prefill(self, eng: "Engine", pb: PrefillBatch) -> None:
        """The strategy's own prefill (its drafter's), after the target's EXTEND over the
        prompts (with ``target_capture_layers`` features) and the roots' sampling."""

    @abstractmethod
    def round(self, eng: "Engine", rb: "RoundBatch") -> None:
        """One round for ``rb.rows`` (device work only): forwards, verify, commit."""

    @staticmethod
    def padded_rows(eng: "Engine", bs: int) -> int:
        """``bs`` request rows as the engine pads a round for its graphs: the batch size that
        picks a round's shapes by batch (:class:`SpecConfig`), so eager and replayed rounds
        of one batch size agree."""
        return next(s for s in padded_sizes(eng.max_batch) if s >= bs)


class PlainDecoding(Strategy):
    """Target-only decoding: each round is one DECODE of the roots."""

    name = "none"
    records_accept_length = False

    def round_modes(self) -> ModeList:
        return [("target", ForwardMode.DECODE)]

    def graph_state_sizes(self, max_batch: int) -> Dict[Role, Tuple[int, int]]:
        return {"target": (max_batch, max_batch)}

    def per_mode_graph_plan(self, eng: "Engine") -> list:
        return [("target", eng.target, eng.target_backend, ForwardMode.DECODE, 1, eng.max_batch)]

    def round(self, eng: "Engine", rb: "RoundBatch") -> None:
        rows = rb.rows
        bs = rows.shape[0]
        # P, the position and slot of the root, and the root, in one launch
        loc = ops.extend_cache_locs(rows, eng.prefix_lens, eng.req_pool.req_to_token, 1, roots=eng.roots,
                                    check_values=False)
        batch = eng.batch(ForwardMode.DECODE, rows, loc.seq_lens, 1, loc.out_cache_loc, positions=loc.positions,
                          host_prefix_lens=rb.host())
        nxt = eng.next_tokens(eng.forward("target", loc.input_ids.view(bs), batch, top_k=eng.greedy_top_k))
        none_accepted = eng.constant(("no_drafts", bs), lambda: torch.zeros(bs, dtype=torch.int32, device=eng.device))
        eng.commit(rb, rows, loc.seq_lens, nxt.reshape(bs, 1), none_accepted)


class EagleStrategy(Strategy):
    """EAGLE drafting (SGLang spec v2's round; ``P`` = target KV committed, ``root`` = last
    emitted token, no target KV yet; the drafter holds the root's entry and its top-k):

    1. draft: ``num_steps - 1`` DECODE steps over ``topk`` beams per request, scoring
       ``topk`` children per beam (beams with ``topk > 1`` run on scratch ``req_to_token``
       rows: prefix + root + ancestors; each beam's entry in a scratch slot, or with pages a
       scratch page holding a copy of the source beam's page, one ``move_kv_cache`` per step);
    2. tree build (``ops.build_tree``) from the ``num_draft_tokens - 1`` best candidates;
    3. TARGET_VERIFY over the ``D`` tree tokens at slots ``req_to_token[r, P : P + D]``;
    4. verify (greedy or lossless speculative sampling), accepted-path compaction and one
       KV move for all target layers;
    5. DRAFT_EXTEND_V2 over a fixed ``L = min(num_steps, D - 1) + 1`` tokens per request
       (accepted drafts, bonus, padding): the drafter's entries for them, and the bonus
       token's top-k (the next round's first step);
    6. commit ``P += accept_length + 1``.

    Drafter entries: a self-speculative drafter (a Llama) keeps one entry per token
    position, like the target.  An EAGLE-3 drafter's entry ``t`` pairs the token at position
    ``t + 1`` with the target's features at position ``t`` (SGLang / vLLM / SpecForge), so
    its entries sit one index lower (``shift = 1``): the root's entry is ``P - 1``, draft
    step ``s`` writes entry ``P - 1 + s``, and DRAFT_EXTEND_V2 writes entries ``P ..``
    from the compacted target features of the accepted path.
    """

    name = "eagle"

    def __init__(self, spec: SpecConfig, target, draft_model=None, max_context: int = 4096):
        self.spec = spec
        # D, L: the largest tree and draft extend (buffers, graph state); a round's own: tree_for
        self.K, self.S, self.D = spec.topk, spec.num_steps, spec.max_num_draft_tokens()
        self.L = min(self.S, self.D - 1) + 1
        if draft_model is not None:
            if draft_model.vocab_size != target.vocab_size or draft_model.device != target.device:
                raise ValueError("draft_model must share the target's vocabulary and device")
            self.drafter = draft_model
        else:
            n = max(1, 3 * target.num_layers // 4) if spec.draft_layers is None else spec.draft_layers
            if not 1 <= n <= target.num_layers:
                raise ValueError(f"draft_layers must be in [1, {target.num_layers}] (the target's layers), got {n}")
            self.drafter = target.with_layers(n)
        self.eagle3 = hasattr(self.drafter, "aux_layer_ids")
        check_draft_vocab_topk(self.drafter, self.K)
        if hasattr(self.drafter, "reserve_positions"):   # fused paths read a RoPE table
            self.drafter.reserve_positions(max_context)
        self.shift = 1 if self.eagle3 else 0
        self.graph_prefill = self.eagle3
        #: the draft's bookkeeping ops: None picks the fused ops (:func:`specattn.ops.eagle_beam_step`,
        #: :func:`specattn.ops.select_draft_tokens`) on CUDA and PyTorch ops elsewhere; "torch",
        #: "auto", "triton" or "reference" force one (tests)
        self.draft_ops_impl: Optional[str] = None
        self.target_capture_layers = tuple(self.drafter.aux_layer_ids) if self.eagle3 else ()
        self.verify_topk = self.draft_topk = self.K
        self.tokens_per_round = max(self.D, self.S + 1)
        self.emit_width = self.D

    # ---------------------------------------------------------------- plan
    def required_modes(self) -> ModeList:
        rm = self.round_modes()
        return [("target", ForwardMode.EXTEND), rm[0], ("draft", ForwardMode.EXTEND)] + rm[1:]

    def round_modes(self) -> ModeList:
        out = [("target", ForwardMode.TARGET_VERIFY), ("draft", ForwardMode.DRAFT_EXTEND_V2)]
        if self.S > 1:
            out.append(("draft", ForwardMode.DECODE))
        return out

    def scratch_shape(self) -> Tuple[int, int]:
        if self.K == 1 or self.S == 1:
            return 0, 0
        return 2 * self.K, self.K * (self.S - 1)

    def graph_state_sizes(self, max_batch: int) -> Dict[Role, Tuple[int, int]]:
        beams = max_batch * self.K
        return {"target": (max_batch, max_batch * self.D),
                "draft": (beams, max(beams, max_batch * self.L))}

    def tree_for(self, eng: "Engine", bs: int) -> Tuple[int, int]:
        """``(D, L)`` of a round over ``bs`` request rows: the verified tokens
        (``spec.num_draft_tokens_for`` the padded batch) and the draft extend's tokens per
        request, ``min(num_steps, D - 1) + 1``."""
        if not self.spec.num_draft_tokens_by_batch:
            return self.D, self.L
        D = self.spec.num_draft_tokens_for(self.padded_rows(eng, bs))
        return D, min(self.S, D - 1) + 1

    def per_mode_graph_plan(self, eng: "Engine") -> list:
        if self.eagle3:  # every forward takes or returns hidden states: eager
            return []
        if self.spec.num_draft_tokens_by_batch:   # a per-mode graph has one shape: only the draft steps'
            return [("draft", self.drafter, eng.draft_backend, ForwardMode.DECODE, 1, eng.max_batch * self.K)] \
                if self.S > 1 else []
        plan = [("target", eng.target, eng.target_backend, ForwardMode.TARGET_VERIFY, self.D, eng.max_batch),
                ("draft", self.drafter, eng.draft_backend, ForwardMode.DRAFT_EXTEND_V2, self.L, eng.max_batch)]
        if self.S > 1:
            plan.append(("draft", self.drafter, eng.draft_backend, ForwardMode.DECODE, 1,
                         eng.max_batch * self.K))
        return plan

    def build(self, eng: "Engine") -> None:
        n, dev = eng.max_batch + 1, eng.device
        self.top_scores = torch.zeros(n, self.K, dtype=torch.float32, device=dev)
        self.top_tokens = torch.zeros(n, self.K, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(n, self.drafter.hidden_size, dtype=eng.dtype, device=dev) \
            if self.eagle3 else None

    def row_state(self) -> List[torch.Tensor]:
        return [self.top_scores, self.top_tokens] + ([] if self.hidden is None else [self.hidden])

    def _top(self, o: "ForwardOut") -> Tuple[torch.Tensor, torch.Tensor]:
        """The drafter's ``K`` best (log-probabilities, target token ids) per row of a forward
        asked for ``top_k=K``: its ``top``, else from its logits (columns of a draft
        vocabulary map back to token ids)."""
        if o.top is not None:
            return o.top
        scores, cols = top_log_probs(o.logits, self.K)
        to_ids = getattr(self.drafter, "draft_token_ids", None)
        return scores, (cols if to_ids is None else to_ids(cols))

    def _kept(self, o: "ForwardOut", hidden: Optional[torch.Tensor]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(state, new rows)`` pairs of what a drafter forward leaves for the next round: its
        top-``K`` (and the EAGLE-3 hidden state of the kept entries), for :func:`ops.scatter_rows`."""
        scores, tokens = self._top(o)
        pairs = [(self.top_scores, scores.contiguous()), (self.top_tokens, tokens.contiguous())]
        if self.hidden is not None:
            pairs.append((self.hidden, hidden.to(self.hidden.dtype).contiguous()))
        return pairs

    def _keep_top(self, rows: torch.Tensor, o: "ForwardOut", hidden: Optional[torch.Tensor]) -> None:
        ops.scatter_rows(rows, self._kept(o, hidden), check_values=False)

    # ---------------------------------------------------------------- prefill
    def prefill(self, eng: "Engine", pb: PrefillBatch) -> None:
        """The drafter's EXTEND over the prompts and roots: self-speculative: tokens
        ``x_0 .. x_n`` (prompt + root) at positions ``0 .. n`` (eager: it reads the host
        lengths); EAGLE-3: tokens ``x_1 .. x_n`` paired with the target's features
        ``g_0 .. g_{n-1}`` at entries ``0 .. n-1``, in the target's own batch (device work)."""
        dev, rtt, rows = eng.device, eng.req_pool.req_to_token, pb.rows
        roots = eng.roots[rows]
        if self.eagle3:  # each prompt shifted left by one, its root last: the prompts' shape
            d_ids = pb.ids.roll(-1)
            d_ids[pb.last] = roots
            o = eng.forward("draft", d_ids, pb.batch, hidden_in=pb.out.features, logit_rows=pb.last,
                            top_k=self.K)
            self._keep_top(rows, o, o.hidden[pb.last])
            return
        lens = pb.lens
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        new_lens = [n + 1 for n in lens]
        d_ids = torch.empty(len(pb.ids) + len(lens), dtype=torch.int64, device=dev)
        src = torch.tensor([i + k for k, (a, b) in enumerate(zip(starts, starts[1:])) for i in range(a, b)],
                           dtype=torch.int64, device=dev)
        d_ids[src] = pb.ids
        last = torch.tensor([b + k for k, b in enumerate(starts[1:])], dtype=torch.int64, device=dev)
        d_ids[last] = roots
        loc = torch.cat([rtt[r, :n] for r, n in zip(rows.tolist(), new_lens)]).long()
        d_batch = ForwardBatch.extend(rows, [0] * len(lens), new_lens, loc, device=dev)
        o = eng.forward("draft", d_ids, d_batch, logit_rows=last, top_k=self.K)
        self._keep_top(rows, o, None)

    # ---------------------------------------------------------------- round
    def _row_state(self, eng: "Engine", rows: torch.Tensor, impl: str) -> "_RoundRows":
        """The round's per-request state, read by request row in one :func:`ops.gather_rows`."""
        names = ["P", "roots", "top_scores", "top_tokens"]
        state = [eng.prefix_lens, eng.roots, self.top_scores, self.top_tokens]
        if self.eagle3:
            names.append("hidden")
            state.append(self.hidden)
        if self.K > 1 and self.S > 1:
            names += ["scratch_rows", "scratch_units"]
            state += [eng.scratch_rows, eng.scratch_pages]
        got = dict(zip(names, ops.gather_rows(rows, state, check_values=False, impl=impl)))
        return _RoundRows(**got)

    def _draft(self, eng: "Engine", rb: "RoundBatch", rows: torch.Tensor, rs: "_RoundRows",
               draft_ops: Optional[str] = None):
        """Steps ``1 .. S-1`` over the beams (``rs``: the rows' state).  Returns
        ``(parent_list [bs, K(S-1)+1], candidate scores [bs, n_cand], candidate tokens [bs,
        n_cand])``.  Index patterns are
        the engine's kept constants or views, so a captured round launches only the kernels
        that depend on the round's values.  ``draft_ops``: None: each step's candidates and
        next beams in PyTorch ops (``topk``, gathers), concatenated at the end; else the
        ``impl`` of :func:`specattn.ops.eagle_beam_step`, one launch per step writing into
        candidate buffers and ``parent_list`` made once per round (same values; ties among
        equal scores go to the lower candidate index)."""
        K, S, sh = self.K, self.S, self.shift
        bs, rtt, ps = rows.shape[0], eng.req_pool.req_to_token, eng.page_size
        P, beam_scores, beam_tokens = rs.P, rs.top_scores, rs.top_tokens
        cand_scores, cand_tokens = [beam_scores], [beam_tokens]
        root_block = eng.constant(("eagle_root_block", K), lambda: torch.cat(
            [torch.full((1,), -1, dtype=torch.int64, device=eng.device), eng.arange(K)]))
        blocks = [root_block[None].expand(bs, K + 1)]
        fused = draft_ops is not None and S > 1
        if fused:  # eagle_beam_step writes each step's block here (step 1 also the root's top-k)
            n_cand = ops.num_tree_candidates(K, S)
            all_scores = torch.empty(bs, n_cand, dtype=torch.float32, device=eng.device)
            all_tokens = torch.empty(bs, n_cand, dtype=torch.int64, device=eng.device)
            parent_list = torch.empty(bs, K * (S - 1) + 1, dtype=torch.int64, device=eng.device)
            parent_list[:, :K + 1] = blocks[0]
        src_rows = rows[:, None].expand(bs, K)
        # EAGLE-3: each step's beams read the hidden rows of the beams they continue (the
        # first step's all the root's), gathered by the drafter's forward
        hid_src = rs.hidden if self.eagle3 else None
        hid_rows = eng.constant(("eagle_root_beams", bs, K), lambda: eng.arange(bs).repeat_interleave(K)) \
            if self.eagle3 else None
        # the fused path forks the beams' scratch rows with one launch per step (page size 1)
        fork = fused and K > 1 and ps == 1
        # every step's new entries at once, [S - 1, bs] (row s - 1: step s's, contiguous)
        step_idx = P[None, :] + eng.constant(("eagle_step_offsets", S, sh), lambda: (
            eng.arange(S - 1) + (1 - sh))[:, None]) if S > 1 else None
        if S > 1:  # the beams' prefix lengths of every step, int32 as the batches take them
            step_prefix = torch.empty(S - 1, bs, K, dtype=torch.int32, device=eng.device)
            step_prefix.copy_(step_idx[:, :, None].expand(S - 1, bs, K))
        if K > 1 and S > 1:
            scratch_rows, scratch_units = rs.scratch_rows, rs.scratch_units  # [bs, 2K], [bs, K(S-1)]
            if fork:  # each parity's K rows contiguous: [2, bs, K]
                parity_rows = scratch_rows.view(bs, 2, K).transpose(0, 1).contiguous()
            elif ps == 1:
                scratch_slots = scratch_units.to(rtt.dtype)                  # (one cast a round)
            c0 = step_idx[0] if ps == 1 else step_idx[0] // ps * ps          # first page of the drafts
            if S > 2 and not fork:  # every step's ancestor columns: step s copies the first s - 1 + ps
                cols_all = (c0[:, None, None] + eng.arange(S - 2 + ps)).clamp(max=eng.max_context - 1)
        for s in range(1, S):
            idx = step_idx[s - 1]                             # the beams' new entries [bs]
            prefix = None
            if K == 1:
                cur = rows[:, None]
                slots = rtt[rows, idx][:, None].long()
            elif fork:  # ancestors' columns from the source beams' rows, then the new slot
                cur = parity_rows[s % 2]
                prefix, slots = ops.fork_req_to_token_rows(
                    rtt, src_rows, cur, c0, s - 1, new_col=idx, new_slots=scratch_units[:, s - 1::S - 1],
                    check_values=False, impl=draft_ops)
            else:
                cur = scratch_rows[:, (s % 2) * K:(s % 2) * K + K]           # [bs, K] (ping-pong)
                if s > 1:  # the ancestors' entries, whole pages of them, from the source beams
                    cols = cols_all[..., :s - 1 + ps]
                    rtt[cur[:, :, None], cols] = rtt[src_rows[:, :, None], cols]
                unit = scratch_units[:, s - 1::S - 1]                        # [bs, K]: beam j's unit s-1
                if ps == 1:
                    slots = unit
                    rtt[cur, idx[:, None].expand(bs, K)] = scratch_slots[:, s - 1::S - 1]
                else:  # a private page holding a copy of the source beam's page
                    start = (idx // ps * ps)[:, None].expand(bs, K)
                    offs = eng.arange(ps)
                    src_first = rtt[src_rows, start].long() // ps * ps
                    page_slots = unit[..., None] * ps + offs                 # [bs, K, ps]
                    eng.draft_pool.move_kv_cache(page_slots.flatten(), (src_first[..., None] + offs).flatten(),
                                                 check_values=False)
                    rtt[cur[..., None], start[..., None] + offs] = page_slots.to(rtt.dtype)
                    slots = page_slots.gather(2, (idx % ps)[:, None, None].expand(bs, K, 1)).squeeze(2)
            if prefix is None:
                prefix = idx[:, None].expand(bs, K).reshape(-1)
            batch = eng.batch(ForwardMode.DECODE, cur.reshape(-1), step_prefix[s - 1].view(-1), 1,
                              slots.reshape(-1), positions=prefix, host_prefix_lens=rb.host(s - sh, repeat=K))
            o = eng.forward("draft", beam_tokens.reshape(-1), batch, hidden_in=hid_src, hidden_rows=hid_rows,
                            top_k=K)
            child_scores, child_tokens = self._top(o)                        # [bs*K, K]
            if fused:  # one launch: this step's candidates, the next beams, their parent block
                nxt = s < S - 1
                step = ops.eagle_beam_step(
                    beam_scores, child_scores, child_tokens, all_scores, all_tokens, K + (s - 1) * K * K,
                    beam_tokens=beam_tokens if s == 1 else None, beam_offset=0 if s == 1 else None,
                    select=nxt, cur_rows=cur if nxt and K > 1 else None,
                    parent_list=parent_list if nxt else None,
                    parent_offset=K + 1 + (s - 1) * K if nxt else None, impl=draft_ops)
                if nxt:
                    beam_scores, beam_tokens, parent = step.scores, step.tokens, step.parents
                    if K > 1:
                        src_rows = step.src_rows
            else:
                child_scores = beam_scores[..., None] + child_scores.view(bs, K, K)
                child_tokens = child_tokens.view(bs, K, K)
                cand_scores.append(child_scores.flatten(1))
                cand_tokens.append(child_tokens.flatten(1))
                if s < S - 1:
                    beam_scores, best = child_scores.flatten(1).topk(K, dim=-1)
                    beam_tokens = child_tokens.flatten(1).gather(1, best)
                    parent = best // K
                    if K > 1:
                        src_rows = cur.gather(1, parent)
                    blocks.append(best + (K + (s - 1) * K * K))
            if s < S - 1 and self.eagle3:
                hid_src = o.hidden                                           # [bs * K, H]
                hid_rows = (parent + eng.constant(("beam_row_base", bs, K),
                                                  lambda: eng.arange(bs)[:, None] * K)).view(-1)
        if K > 1 and S > 1:  # undo the scratch rows' columns: the next round's prefix is there
            width = (-(-(S - 1) // ps) + 1) * ps
            if fused:
                ops.fork_req_to_token_rows(rtt, rows[:, None].expand(bs, 2 * K), scratch_rows, c0, width,
                                           check_values=False, impl=draft_ops)
            else:
                cols = (c0[:, None] + eng.arange(width)).clamp(max=eng.max_context - 1)
                rtt[scratch_rows[:, :, None], cols[:, None, :]] = rtt[rows[:, None, None], cols[:, None, :]]
        if fused:
            return parent_list, all_scores, all_tokens
        parent_list = torch.cat(blocks, 1) if S > 1 else \
            torch.full((bs, 1), -1, dtype=torch.int64, device=eng.device)
        return parent_list, torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1)

    def round(self, eng: "Engine", rb: "RoundBatch") -> None:
        K, S, sh = self.K, self.S, self.shift
        rows, rtt = rb.rows, eng.req_pool.req_to_token
        bs = rows.shape[0]
        D, L = self.tree_for(eng, bs)
        # the draft's bookkeeping: fused ops (eagle_beam_step per step, select_draft_tokens,
        # the rows' state in one gather and one scatter; Triton) on CUDA, PyTorch ops
        # elsewhere and beyond the ops' limits (draft_ops_impl)
        draft_ops = self.draft_ops_impl or ("auto" if rows.is_cuda else "torch")
        if draft_ops == "torch" or K > ops.EAGLE_MAX_TOPK or \
                ops.num_tree_candidates(K, S) > ops.EAGLE_MAX_CANDIDATES:
            draft_ops = None
        rs = self._row_state(eng, rows, "reference" if draft_ops is None else draft_ops)
        P = rs.P
        parent_list, scores, tokens = self._draft(eng, rb, rows, rs, draft_ops)
        if draft_ops is None:
            selected = ops.order_keys(scores).topk(D - 1, dim=-1).indices.sort(dim=-1).values   # the fused order
            draft_tokens = torch.cat([rs.roots[:, None], tokens.gather(1, selected)], 1)
        else:
            selected, draft_tokens = ops.select_draft_tokens(scores, tokens, rs.roots, D, impl=draft_ops)
        loc = ops.extend_cache_locs(rows, eng.prefix_lens, rtt, D, check_values=False)   # P as int32, slots
        tree = ops.build_tree(parent_list, selected, loc.seq_lens, K, S, D)
        out_cache_loc = loc.out_cache_loc
        batch = eng.batch(ForwardMode.TARGET_VERIFY, rows, P, D, out_cache_loc, positions=tree.positions,
                          tree_mask=tree.tree_mask, host_prefix_lens=rb.host())
        t = eng.forward("target", draft_tokens.flatten(), batch, capture_layers=self.target_capture_layers,
                        top_k=eng.greedy_top_k)
        cp, n_acc = eng.verify_and_compact(draft_tokens, tree, t, S, out_cache_loc, hidden_states=t.features,
                                           chain=K == 1 and D == S + 1)   # all S drafts: in order
        path = cp.predicts.view(bs, D).long()          # accepted drafts + bonus first
        first = P + (1 - sh)                            # the drafter entry of path[:, 0]
        if 1 - sh + L <= D:  # the verify's slots already hold these columns (req_to_token is unchanged since)
            ext_loc = out_cache_loc.view(bs, D)[:, 1 - sh:1 - sh + L].flatten()
        else:
            ext_loc = rtt[rows[:, None], first[:, None] + eng.arange(L)].long().flatten()
        batch = eng.batch(ForwardMode.DRAFT_EXTEND_V2, rows, first, L, ext_loc,
                          host_prefix_lens=rb.host(1 - sh))
        hid = cp.hidden_states.view(bs, D, -1)[:, :L].reshape(bs * L, -1) if self.eagle3 else None
        row_starts = eng.constant(("row_starts", bs, L), lambda: eng.arange(bs) * L)
        at = row_starts + n_acc                         # the bonus token's entry
        o = eng.forward("draft", path[:, :L].flatten(), batch, hidden_in=hid, logit_rows=at, top_k=K)
        eng.commit(rb, rows, P, path, n_acc, also=self._kept(o, None if o.hidden is None else o.hidden[at]))


def make_strategy(spec: SpecConfig, target, draft_model=None, max_context: int = 4096) -> Strategy:
    """The strategy of ``spec.algo`` for ``target`` (``draft_model``: EAGLE's drafter;
    ``max_context``: the most positions a request reaches, for drafters' RoPE tables)."""
    spec.validate()
    if spec.algo == "none":
        return PlainDecoding()
    if spec.algo == "eagle":
        return EagleStrategy(spec, target, draft_model, max_context)
    if spec.algo == "ngram":
        from .ngram import NgramStrategy
        return NgramStrategy(spec)
    from .dflash import DFlashStrategy
    return DFlashStrategy(spec, target, max_context, draft_model)
