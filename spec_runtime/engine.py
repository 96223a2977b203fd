"""The step loop: target-only decoding, EAGLE (chain and tree) and DFlash speculative decoding
with spec-v2 semantics, on any ``AttentionBackend``, with the rounds on the device.

Layout
------
- The engine owns the pools, the backends, the per-request state on the device and the host
  loop.  Each decoding *algorithm* is a :class:`~specattn.spec_runtime.strategies.Strategy`
  (``none``, ``eagle``, ``dflash``: :func:`~specattn.spec_runtime.strategies.make_strategy`)
  that says which forward modes it needs, prefills its drafter and runs one *round* through
  the engine's public operations (:meth:`Engine.batch`, :meth:`Engine.forward`,
  :meth:`Engine.sample`, :meth:`Engine.verify_and_compact`, :meth:`Engine.commit`).  New
  drafters plug in as new strategies; the engine never branches on the algorithm.
- Slots are reserved up front: request row ``r`` (one of ``max_batch``) owns the KV slots of
  positions ``0 .. max_context - 1`` for the engine's lifetime (``req_to_token[r]`` is
  filled once, page by page: position ``p`` at offset ``p % page_size`` of its page).  A
  round therefore allocates nothing: the verify writes at ``req_to_token[r, P : P + D]``,
  the accepted path is compacted there, and committing is ``P += accept_length + 1``.
  EAGLE trees with ``topk > 1`` also get per-request scratch rows and pages (one per beam
  and draft step), as SGLang copies the last partial page per beam.
- A round is device work only: no host sync, no data-dependent shape, no allocation that
  depends on values.  Its inputs are the request rows (``RoundBatch.rows``), its outputs
  the tokens it emits per request (``emit_tokens``, ``emit_count``) and the updated state
  (``prefix_lens``, ``roots`` and the strategy's own).
- With ``cuda_graph=True`` and backends whose graph metadata is device work
  (``backend.device_metadata``: ``triton``, ``torch_reference``), the WHOLE round is one CUDA
  graph per padded batch size (1, 2, 4, 8, 16, 24, ...; padding rows point at a dummy
  request whose state is reset at the end of every round), and the host loop overlaps: it
  queues round ``n + 1`` before it reads round ``n``'s tokens (one pinned copy + one event
  per round), as SGLang's spec-v2 overlap scheduler does.  A request that finished in round
  ``n`` has the tokens of round ``n + 1`` dropped.
- Other backends (FlashInfer plans on the host; FlashMLA needs a forward before capture)
  run the same round function from the host, one round at a time, with host copies of the
  lengths for their planners and per-mode CUDA graphs for the plain forwards
  (:class:`~specattn.spec_runtime.graph_runner.GraphRunner`); the others run eagerly
  (:attr:`Engine.eager_routed`).

Routing: at construction the engine asks ``backend.supports(mode, graph=False, kind=...)``
for every mode its strategy runs on each model; a mode the backend lacks goes to the
``triton`` backend over the same pools when that one supports it
(:class:`~specattn.backends.RoutedBackend`, listed in :attr:`Engine.mode_routed`), else
construction raises ``UnsupportedError`` naming what is missing.
"""
from __future__ import annotations

import numbers
import operator
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specattn import ops
from specattn.ops.checks import capturing
from specattn.backends import (ForwardBatch, ForwardMode, ReqToTokenPool, RoutedBackend,
                               UnsupportedError, create_backend)

from .graph_runner import GraphRunner, padded_sizes, padded_tokens
from .model import LlamaModel
from .sampling import SamplingParams, greedy_tokens, logits_to_probs, sample
from .strategies import PrefillBatch, SpecConfig, Strategy, make_strategy

__all__ = ["Engine", "SpecConfig", "GenerateResult", "ForwardOut", "RoundBatch", "Request"]


@dataclass
class Request:
    """Host-side bookkeeping of one request (its device state lives in the engine)."""

    rid: int
    prompt: List[int]
    row: int = -1
    output: List[int] = field(default_factory=list)
    accept_lengths: List[int] = field(default_factory=list)
    max_new_tokens: int = 32
    finished: bool = False
    finish_reason: str = ""


@dataclass
class GenerateResult:
    tokens: List[List[int]]
    finish_reasons: List[str]
    accept_lengths: List[List[int]]   # per request, per round: accepted drafts (bonus excluded)
    seconds: float
    num_forward_target: int
    num_rounds: int = 0
    wait_seconds: float = 0.0         # host time blocked waiting for rounds' results

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens emitted per target verify (accepted drafts + bonus); 1.0 without spec."""
        rounds = [a for per in self.accept_lengths for a in per]
        return 1.0 + sum(rounds) / len(rounds) if rounds else 1.0


@dataclass
class _Admission:
    """A prefill whose roots the host has not read yet: ``roots`` int64 CPU ``[rows]`` (by
    request row; pinned and filled by a copy that ``event`` marks on a GPU)."""

    reqs: List[Request]
    roots: torch.Tensor
    event: Optional[torch.cuda.Event]


@dataclass
class ForwardOut:
    """What :meth:`Engine.forward` returns: float32 ``logits [T, V]``; ``hidden [T, H]`` (the
    drafter's pre-norm state for its next step, EAGLE-3; the final normed hidden for plain
    models, None from a per-mode graph); ``features [T, n * H]``: the residual stream after
    each requested layer, concatenated (None when none were asked); ``top``: ``(values
    float32 [T, k], token ids int64 [T, k])``, the ``k`` best log-probabilities per row, when
    the forward was asked ``top_k=k`` and the model's LM head computed them without the
    logits (``logits`` is None then; a drafter's draft-vocabulary columns are already token
    ids here)."""

    logits: Optional[torch.Tensor]
    hidden: Optional[torch.Tensor] = None
    features: Optional[torch.Tensor] = None
    top: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def greedy_tokens(self) -> torch.Tensor:
        """int64 ``[T]``: each row's argmax (the lowest token id among ties)."""
        if self.top is not None and self.top[0].shape[1] == 1:
            return self.top[1][:, 0]
        return greedy_tokens(self.logits)


@dataclass
class RoundBatch:
    """One round's requests: ``rows`` int64 ``[bs]`` (request rows; the dummy row for
    padding), and where the round writes what it emits: ``emitted`` int64 ``[bs, 1 + W]``,
    column 0 the count of request ``i``'s new tokens (``emit_count``), then the tokens
    (``emit_tokens``; the first ``count`` are valid), so the host reads one contiguous block.
    ``host_prefix_lens`` (int32 CPU ``[bs]``) only when the backends plan on the host (the
    engine then runs rounds one at a time and reads the lengths first)."""

    rows: torch.Tensor
    emitted: torch.Tensor
    host_prefix_lens: Optional[torch.Tensor] = None

    @property
    def bs(self) -> int:
        return self.rows.shape[0]

    @property
    def emit_tokens(self) -> torch.Tensor:
        return self.emitted[:, 1:]

    @property
    def emit_count(self) -> torch.Tensor:
        return self.emitted[:, 0]

    def host(self, offset: int = 0, repeat: int = 1) -> Optional[torch.Tensor]:
        """Host copies of ``prefix_lens + offset`` (each repeated ``repeat`` times), or None."""
        if self.host_prefix_lens is None:
            return None
        return self.host_prefix_lens.repeat_interleave(repeat) + offset


def default_min_free_slots(max_batch: int) -> int:
    """The engine's default admission batching for ``max_batch`` request rows:
    ``max(1, round(sqrt(max_batch)) - 1)`` rows free before waiting requests are prefilled
    (1 up to batch 6, 2 at 8, 3 at 16, 7 at 64).

    A freed row left idle costs ``1 / max_batch`` of a round per round it waits, while each
    prefill it shares saves a whole small launch-bound forward (about 1 ms of kernels at
    batch 1 on an H200 with the 135M model, near a bs-16 round), so the wait pays more the
    more rows share a round.  Measured at batch 16 (EAGLE tree, H200, 64 chat requests x 128
    tokens, speedup over plain decoding): 1 -> 1.25x / 1.26x, 2 -> 1.27x / 1.28x,
    3 -> 1.32x / 1.29x / 1.32x, 4 -> 1.28x.

    Raises:
        ValueError: ``max_batch < 1``.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return max(1, round(max_batch ** 0.5) - 1)


class Engine:
    """Runs a Llama model (and its drafter) over the pools and backends.

    Args:
        config, weights: from :mod:`specattn.spec_runtime.loader` (a Llama), or a ready model
            as ``config`` with ``weights=None``: any object with ``forward``, ``logits``,
            ``make_kv_pool``, ``with_layers``, ``num_layers``, ``device`` (e.g. the MLA model).
        spec: :class:`SpecConfig`.
        device, dtype: where and in what a Llama built from ``weights`` runs (default CPU,
            float32); a ready model runs where it is, and every pool follows it.
        backend: attention backend name (``specattn.backends.create_backend``).
        max_batch, max_context: capacity (requests at once, token positions per request;
            every request row reserves ``max_context`` KV slots up front).
        page_size: KV page size of every pool (``max_context`` a multiple of it); e.g. 64
            for FlashMLA.
        eos_token_ids: generation stops after emitting one of these (ints in the vocabulary;
            TypeError / ValueError else).  Default none: a config's EOS ids are not read here.
        draft_model: the drafter, or a callable ``target -> drafter`` that builds one over
            the engine's target.  EAGLE: a Llama over the target's vocabulary (run like the
            target) or an EAGLE-3 drafter (:class:`~specattn.spec_runtime.eagle3.Eagle3Drafter`,
            fed the target's hidden states); default: the target's first ``draft_layers``
            layers.  DFlash: a trained :class:`~specattn.spec_runtime.dflash.DFlashDrafter`;
            default: a random-init one.
        cuda_graph: CUDA graphs (GPU only, captured at construction for greedy decoding and
            at first use for a sampling configuration): whole rounds when every backend
            builds its graph metadata on the device, else per-mode graphs of the plain
            forwards (see the module docstring).
        prefill_graph_tokens: with whole-round graphs, prefills of up to this many
            (padded) prompt tokens also replay CUDA graphs, one per padded batch size and
            token count (:func:`~specattn.spec_runtime.graph_runner.padded_tokens`),
            captured at first use; 0: prefills run eagerly.
        min_free_slots: continuous batching's admission batching: while requests run, the
            waiting ones are prefilled only once at least ``min(min_free_slots, waiting)``
            rows are free, or a free row has waited ``max_admission_delay`` rounds, so
            rows freed one at a time share one prefill (a speculative round's prefill also
            runs the drafter's).  1: every free row is filled at once.  None (default):
            :func:`default_min_free_slots` of ``max_batch``.  SGLang's ``min_free_slots``
            delayer (its default for DFlash drafters) is the same rule.
        max_admission_delay: the most rounds a free row waits for others (>= 0).
        overlap: whether :meth:`generate` queues round ``n + 1`` before it reads round
            ``n`` (None, the default: with whole-round graphs, where the GPU then runs while
            the host reads; eager rounds gain nothing from it, but run it the same way with
            True).
        kv_cache_dtype: the target's KV cache dtype (default: the model's);
            ``torch.float8_e4m3fn`` stores it in e4m3 with ``kv_scales = (k_scale, v_scale)``
            (each a float or one per layer; an MLA latent has one scale, so both must be equal,
            as :func:`~specattn.spec_runtime.near_greedy.calibrate_kv_scales` returns them),
            which SGLang and vLLM default to 1.0 as here.  The drafter's pool keeps the model's dtype (a
            draft's KV is a few layers; its precision only moves the acceptance).

    Attributes:
        target_backend, draft_backend: the backends (``draft_backend`` only with a drafter).
        draft: the drafter model (None for ``algo="none"``).
        round_graphs: ``{(padded_bs, sampling key, prefix bound): CUDAGraph}`` of whole
            rounds (:meth:`prefix_bounds`).
        prefill_graphs: ``{(padded_bs, padded tokens, sampling key): (CUDAGraph, its input)}``.
        runners: per-mode graph runners (host-planned backends only).
        graph_modes: ``"target:DECODE"``-style names of the (model, mode) pairs that run
            inside CUDA graphs.
        eager_routed: the same for modes run eagerly under ``cuda_graph=True``.
        mode_routed: ``"target:TARGET_VERIFY->triton"``-style names of the modes the named
            backend lacks, run by the ``triton`` backend over the same pools.

    Raises:
        TypeError: ``spec`` not a SpecConfig, a size that is not an int, bad ``eos_token_ids``.
        ValueError: bad ``spec``, ``draft_model``, ``page_size``, ``prefill_graph_tokens``,
            ``min_free_slots`` / ``max_admission_delay``, ``cuda_graph`` off CUDA, or a
            ``device`` other than the ready model's.
        KeyError, ImportError: from ``create_backend`` (unknown / unavailable backend).
        UnsupportedError: the backend does not support (eagerly) a mode the algorithm needs
            for the model's attention kind; the message names every missing (model, mode).
    """

    def __init__(self, config, weights: Optional[Dict[str, torch.Tensor]] = None, *, spec: SpecConfig = None,
                 backend: str = "torch_reference", device=None, dtype=torch.float32,
                 max_batch: int = 8, max_context: int = 1024, eos_token_ids: Sequence[int] = (),
                 cuda_graph: bool = False, draft_model=None, page_size: int = 1,
                 prefill_graph_tokens: int = 4096, min_free_slots: Optional[int] = None,
                 max_admission_delay: int = 16, kv_cache_dtype: Optional[torch.dtype] = None,
                 kv_scales: Tuple = (1.0, 1.0), overlap: Optional[bool] = None):
        self.spec = SpecConfig() if spec is None else spec
        if not isinstance(self.spec, SpecConfig):
            raise TypeError(f"spec must be a SpecConfig, got {type(spec).__name__}")
        self.spec.validate()
        for name, v in (("max_batch", max_batch), ("max_context", max_context), ("page_size", page_size),
                        ("prefill_graph_tokens", prefill_graph_tokens), ("max_admission_delay", max_admission_delay)) + (
                (("min_free_slots", min_free_slots),) if min_free_slots is not None else ()):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        if page_size < 1 or max_context % page_size:
            raise ValueError(f"max_context ({max_context}) must be a multiple of page_size ({page_size})")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {prefill_graph_tokens}")
        if min_free_slots is None:
            min_free_slots = default_min_free_slots(max_batch)
        if not 1 <= min_free_slots <= max_batch:
            raise ValueError(f"min_free_slots must be in [1, max_batch={max_batch}], got {min_free_slots}")
        if max_admission_delay < 0:
            raise ValueError(f"max_admission_delay must be >= 0, got {max_admission_delay}")
        self.prefill_graph_tokens = prefill_graph_tokens
        self.min_free_slots, self.max_admission_delay = min_free_slots, max_admission_delay
        self.overlap = overlap
        try:    # ints (numpy ints and 0-d tensors too): a tensor in a set would never match a token
            if isinstance(eos_token_ids, (str, bytes)) or any(isinstance(t, bool) for t in eos_token_ids):
                raise TypeError
            self.eos = {int(operator.index(t)) for t in eos_token_ids}
        except TypeError:
            raise TypeError(f"eos_token_ids must be a sequence of int token ids, got {eos_token_ids!r}") from None
        if weights is not None:
            self.target = LlamaModel(config, weights, "cpu" if device is None else device, dtype)
        else:  # a ready model brings its device (and dtype)
            self.target = config
            if device is not None and torch.empty(0, device=device).device != config.device:
                raise ValueError(f"device={device} differs from the ready model's {config.device}")
        self.device, self.dtype = self.target.device, self.target.dtype
        V = self.target.vocab_size
        if any(not 0 <= t < V for t in self.eos):   # one that cannot occur would never end a request
            raise ValueError(f"eos_token_ids must lie in the vocabulary [0, {V}), got {sorted(self.eos)}")
        if cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph needs a CUDA device")
        self.max_batch, self.max_context, self.page_size = max_batch, max_context, page_size
        if hasattr(self.target, "reserve_positions"):
            self.target.reserve_positions(max_context)
        if draft_model is not None and not hasattr(draft_model, "make_kv_pool"):
            draft_model = draft_model(self.target)   # a factory over the target
        self.strategy: Strategy = make_strategy(self.spec, self.target, draft_model, max_context)
        self._layout()
        self.mode_routed: List[str] = []
        roles: Dict[str, List[ForwardMode]] = {}
        for role, mode in self.required_modes():
            roles.setdefault(role, []).append(mode)
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        self.target_pool = self.target.make_kv_pool(self.pool_size, page_size, kv_cache_dtype=self.kv_cache_dtype,
                                                    k_scale=kv_scales[0], v_scale=kv_scales[1])
        self.target_backend = self._make_backend(backend, "target", self.target_pool, roles["target"],
                                                 self.strategy.verify_topk)
        self.draft = self.strategy.drafter
        self.draft_pool = self.draft_backend = None
        if self.draft is not None:
            self.draft_pool = self.draft.make_kv_pool(self.pool_size, page_size)
            self.draft_backend = self._make_backend(backend, "draft", self.draft_pool, roles["draft"],
                                                    self.strategy.draft_topk)
        self._check_support()
        # device state of every request row (+ the dummy row that padding points at)
        n = max_batch + 1
        self.prefix_lens = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.roots = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.strategy.build(self)
        # the dummy row's state, zeroed after each round: zero sources made here, outside any
        # capture, written with one ops.scatter_rows launch per MAX_ROW_TENSORS tensors
        state = [self.prefix_lens, self.roots, *self.strategy.row_state()]
        self._dummy_index = torch.full((1,), self.dummy_row, dtype=torch.int64, device=self.device)
        zeros = [(t, torch.zeros((1,) + tuple(t.shape[1:]), dtype=t.dtype, device=self.device)) for t in state]
        self._dummy_resets = [zeros[i:i + ops.MAX_ROW_TENSORS] for i in range(0, len(zeros), ops.MAX_ROW_TENSORS)]
        self.generator = torch.Generator(device=self.device)
        self.num_forward_target = 0
        self.params = SamplingParams()
        self.runners: Dict[Tuple[int, ForwardMode], object] = {}
        self.round_graphs: Dict[Tuple[int, tuple, int], torch.cuda.CUDAGraph] = {}
        self.graph_modes: List[str] = []
        self.eager_routed: List[str] = []
        self._graph_mode = False       # forwards take their metadata from the graph builders
        self._rows_now = None          # (padded bs, rows) the static rows buffer holds
        self._graph_pool = None
        self._constants: Dict[tuple, torch.Tensor] = {}
        self.whole_round_graphs = False
        self.prefill_graphs_on = False
        self.prefill_graphs: Dict[Tuple[int, int, tuple], Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if cuda_graph:
            self._plan_graphs()

    # ------------------------------------------------------------------ layout
    def _layout(self) -> None:
        """Rows, slots and pages, fixed for the engine's lifetime (module docstring)."""
        B, ps, W = self.max_batch, self.page_size, self.max_context
        ppr = W // ps                                     # pages per request row
        scratch_rows, scratch_units = self.strategy.scratch_shape()   # per request
        self.dummy_row = B
        self.num_rows = (B + 1) * (1 + scratch_rows)
        self.req_pool = ReqToTokenPool(self.num_rows, W, self.device)
        # pages: 0 reserved (padding), then each request's ppr pages, then the scratch pages
        self.pool_size = ps * (B * ppr + B * scratch_units)
        pos = torch.arange(W)
        pages = 1 + torch.arange(B)[:, None] * ppr + pos[None, :] // ps
        rtt = self.req_pool.req_to_token
        rtt[:B] = (pages * ps + pos % ps).to(rtt.device, rtt.dtype)
        rtt[B] = 0
        # scratch rows of request row r: B + 1 + r * scratch_rows + j; start as copies of row r
        self.scratch_rows = (B + 1 + torch.arange((B + 1) * scratch_rows).view(B + 1, scratch_rows)
                             ).to(self.device) if scratch_rows else None
        if scratch_rows:
            rtt[B + 1:] = rtt[:B + 1].repeat_interleave(scratch_rows, 0)
        # scratch pages of request row r: unit u -> page 1 + B * ppr + r * units + u (dummy: page 0)
        if scratch_units:
            first = 1 + B * ppr + torch.arange(B)[:, None] * scratch_units + torch.arange(scratch_units)
            self.scratch_pages = torch.cat([first, torch.zeros(1, scratch_units, dtype=torch.int64)]
                                           ).to(self.device)
        else:
            self.scratch_pages = None

    # ------------------------------------------------------------------ backends
    def required_modes(self) -> List[Tuple[str, ForwardMode]]:
        """``(role, mode)`` for every forward this engine's strategy runs, ``role`` in
        ``"target"``, ``"draft"`` (the target's EXTEND always: the prefill)."""
        return self.strategy.required_modes()

    def _make_backend(self, name: str, role: str, pool, modes, topk: Optional[int]):
        """Backend ``name`` over ``pool``; the modes it lacks (eagerly) go to ``triton`` over the
        same pools when triton runs them (recorded in :attr:`mode_routed`)."""
        backend = create_backend(name, self.req_pool, pool, topk=topk)
        missing = [m for m in modes if not backend.supports(m, graph=False, kind=backend.kind)]
        if not missing or name == "triton":
            return backend
        try:
            fallback = create_backend("triton", self.req_pool, pool, topk=topk)
        except (ImportError, UnsupportedError):
            return backend  # _check_support names what is missing
        routes = {m: fallback for m in missing if fallback.supports(m, graph=False, kind=fallback.kind)}
        if not routes:
            return backend
        self.mode_routed += [f"{role}:{m.name}->{fallback.name}" for m in routes]
        return RoutedBackend(backend, routes)

    def backend_of(self, role: str):
        """The backend of ``role`` (``"target"`` or ``"draft"``)."""
        return self.target_backend if role == "target" else self.draft_backend

    def model_of(self, role: str):
        """The model of ``role`` (``"target"`` or ``"draft"``)."""
        return self.target if role == "target" else self.draft

    def _check_support(self) -> None:
        """Raise ``UnsupportedError`` unless every required mode is supported eagerly."""
        missing = []
        for role, mode in self.required_modes():
            b = self.backend_of(role)
            if not b.supports(mode, graph=False, kind=b.kind):
                missing.append(f"{role} {mode.name} ({b.kind.name})")
        if missing:
            raise UnsupportedError(f"backend {self.target_backend.name!r} does not support "
                                   f"{', '.join(missing)} needed by algo {self.spec.algo!r}")

    # ------------------------------------------------------------------ graphs
    def _plan_graphs(self) -> None:
        """Whole-round graphs when every round mode is capturable by a backend that builds
        its metadata on the device; else per-mode graphs (:meth:`graph_plan`)."""
        round_modes = self.strategy.round_modes()
        whole = all(self.backend_of(role).device_metadata and
                    self.backend_of(role).supports(mode, graph=True, kind=self.backend_of(role).kind)
                    for role, mode in round_modes)
        self._graph_pool = torch.cuda.graph_pool_handle()
        if whole:
            self.whole_round_graphs = True
            extend_roles = {role for role, mode in self.required_modes() if mode == ForwardMode.EXTEND}
            self.prefill_graphs_on = self.strategy.graph_prefill and self.prefill_graph_tokens > 0 and all(
                self.backend_of(r).device_metadata and
                self.backend_of(r).supports(ForwardMode.EXTEND, graph=True, kind=self.backend_of(r).kind)
                for r in extend_roles)
            sizes = self.strategy.graph_state_sizes(self.max_batch)
            for role in extend_roles if self.prefill_graphs_on else ():
                max_bs, max_tokens = sizes.get(role, (1, 1))
                sizes[role] = (max(max_bs, self.max_batch), max(max_tokens, self.prefill_graph_tokens))
            for role, (max_bs, max_tokens) in sizes.items():
                self.backend_of(role).init_cuda_graph_state(max_bs, max_tokens)
            self.graph_modes = [f"{role}:{mode.name}" for role, mode in round_modes]
            self._static = self._round_buffers(self.max_batch)
            for pbs in reversed(padded_sizes(self.max_batch)):
                self._capture_round(pbs, SamplingParams(), self.max_context)
            return
        plan = self.graph_plan(self.strategy.per_mode_graph_plan(self))
        sizes: Dict[int, Tuple[int, int]] = {}
        for role, model, backend, mode, D, bs in plan:  # one static state per backend, sized for all
            mb, mt = sizes.get(id(backend), (0, 0))
            sizes[id(backend)] = (max(mb, bs), max(mt, bs * D))
        for backend in {id(p[2]): p[2] for p in plan}.values():
            backend.init_cuda_graph_state(*sizes[id(backend)])
        for role, model, backend, mode, D, bs in plan:
            self.runners[(id(model), mode)] = GraphRunner(model, backend, mode, D, padded_sizes(bs),
                                                          self._graph_pool)

    def graph_plan(self, candidates) -> list:
        """Keep the ``(role, model, backend, mode, ...)`` entries whose backend can capture
        ``mode`` (``supports(mode, graph=True)``); record the rest in :attr:`eager_routed`.
        Round modes that are not in ``candidates`` (forwards that take or return hidden
        states) are recorded as eager too."""
        keep, names = [], set()
        for entry in candidates:
            role, _, backend, mode = entry[:4]
            names.add((role, mode))
            if backend.supports(mode, graph=True, kind=backend.kind):
                keep.append(entry)
                self.graph_modes.append(f"{role}:{mode.name}")
            else:
                self.eager_routed.append(f"{role}:{mode.name}")
        for role, mode in self.strategy.round_modes():
            if (role, mode) not in names and f"{role}:{mode.name}" not in self.eager_routed:
                self.eager_routed.append(f"{role}:{mode.name}")
        return keep

    def _round_buffers(self, bs: int) -> RoundBatch:
        dev = self.device
        W = self.strategy.emit_width
        return RoundBatch(torch.full((bs,), self.dummy_row, dtype=torch.int64, device=dev),
                          torch.zeros(bs, 1 + W, dtype=torch.int64, device=dev))

    @staticmethod
    def _sampling_key(params: SamplingParams) -> tuple:
        return ("greedy",) if params.greedy else (params.temperature, params.top_k, params.top_p)

    def prefix_bounds(self) -> List[int]:
        """The prefix bounds round graphs are captured for: 128, 256, ... (powers of two
        below ``max_context``), then ``max_context``.  A round replays the graph of the
        smallest bound above every request's prefix (the backends may split the KV of
        shorter prefixes less: ``AttentionBackend.graph_prefix_bound``)."""
        out, b = [], 128
        while b < self.max_context:
            out.append(b)
            b *= 2
        return out + [self.max_context]

    def _capture_round(self, pbs: int, params: SamplingParams, prefix_bound: int) -> None:
        """Capture one round for ``pbs`` padded requests (all pointing at the dummy row during
        capture) under the sampling configuration ``params``, for prefixes up to
        ``prefix_bound``."""
        rb = RoundBatch(self._static.rows[:pbs], self._static.emitted[:pbs])
        rb.rows.fill_(self.dummy_row)
        backends = [b for b in (self.target_backend, self.draft_backend) if b is not None]
        for b in backends:
            b.graph_prefix_bound = prefix_bound
        try:
            g = self._capture(lambda: self.strategy.round(self, rb), params)
        finally:
            self._rows_now = None  # the static rows now point at the dummy row
            for b in backends:
                b.graph_prefix_bound = None
        self.round_graphs[(pbs, self._sampling_key(params), prefix_bound)] = g

    def _capture(self, body, params: SamplingParams) -> torch.cuda.CUDAGraph:
        """``body()`` + the dummy row's reset, run once on a side stream (JIT compiles,
        allocator, lazy inits) and then captured in the engine's graph pool under the sampling
        configuration ``params`` (graph-mode metadata builders; the engine's generator
        registered for sampling)."""
        saved, self.params = self.params, params
        self._graph_mode = True
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                body()
                self._reset_dummy()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            if not params.greedy:
                g.register_generator_state(self.generator)
            with torch.cuda.graph(g, pool=self._graph_pool):
                body()
                self._reset_dummy()
        finally:
            self._graph_mode = False
            self.params = saved
        return g

    @staticmethod
    def _graphs_can_sample(params: SamplingParams) -> bool:
        """Greedy rounds always capture; sampling rounds need torch's graph-safe custom
        generators (``CUDAGraph.register_generator_state``), else they run from the host."""
        return params.greedy or hasattr(torch.cuda.CUDAGraph, "register_generator_state")

    def _reset_dummy(self) -> None:
        for pairs in self._dummy_resets:
            ops.scatter_rows(self._dummy_index, pairs, check_values=False)

    # ------------------------------------------------------------------ public ops for strategies
    def batch(self, mode: ForwardMode, rows: torch.Tensor, prefix_lens: torch.Tensor, n: int,
              out_cache_loc: torch.Tensor, positions: Optional[torch.Tensor] = None,
              tree_mask: Optional[torch.Tensor] = None,
              host_prefix_lens: Optional[torch.Tensor] = None) -> ForwardBatch:
        """A fixed-shape ``ForwardBatch`` from device tensors, no host sync: ``rows`` int64
        ``[bs]``, ``prefix_lens`` ``[bs]`` (KV committed before, any int dtype), ``n`` tokens
        per request (DECODE: 1), ``out_cache_loc`` ``[bs * n]``; ``positions`` default to
        ``prefix_lens + j``.  ``host_prefix_lens`` (CPU) become the batch's host copies for
        backends that plan on the host."""
        bs, dev = rows.shape[0], rows.device
        seq = prefix_lens.to(torch.int32)
        if positions is None:  # (one token per request: the prefix lengths themselves)
            positions = prefix_lens.long() if n == 1 else (prefix_lens.long()[:, None] + self.arange(n)).flatten()
        host = None if host_prefix_lens is None else host_prefix_lens.to(torch.int32)
        extend_lens = self.constant(("extend_lens", bs, n),
                                    lambda: torch.full((bs,), n, dtype=torch.int32, device=dev))
        return ForwardBatch(mode, rows, seq, extend_lens,
                            out_cache_loc.long(), positions.long(),
                            num_tokens_per_req=n if mode.has_fixed_tokens_per_req() else None,
                            tree_mask=tree_mask, prefix_lens_cpu=host,
                            extend_lens_cpu=None if host is None else torch.full_like(host, n))

    def constant(self, key: tuple, make):
        """A read-only device tensor (or tuple of them) of a round -- an index pattern, an
        ``arange`` -- kept under ``key`` across rounds, so a captured round does not rebuild
        it: ``make()`` builds it on first use.  It is kept only when made outside a CUDA-graph
        capture (a tensor made inside one holds its values only while that graph replays);
        inside a capture a missing one is built in the graph, every replay.  Callers must
        never write to it."""
        t = self._constants.get(key)
        if t is None:
            t = make()
            if not capturing():
                self._constants[key] = t
        return t

    def arange(self, n: int) -> torch.Tensor:
        """int64 ``[0, n)`` on the engine's device (a kept :meth:`constant`)."""
        return self.constant(("arange", n), lambda: torch.arange(n, device=self.device))

    def forward(self, role: str, input_ids: torch.Tensor, batch: ForwardBatch,
                hidden_in: Optional[torch.Tensor] = None, capture_layers: Sequence[int] = (),
                logit_rows: Optional[torch.Tensor] = None, top_k: Optional[int] = None,
                hidden_rows: Optional[torch.Tensor] = None) -> ForwardOut:
        """One forward of ``role``'s model over ``batch`` (metadata built here: eagerly, by
        the graph builders inside a whole-round capture, or by a per-mode graph's replay).
        ``hidden_in [T, *]`` feeds an EAGLE-3 drafter (``[N, *]`` read at the int64 ``[T]``
        ``hidden_rows`` when given); ``capture_layers`` asks the model for
        the residual stream after those layers (``ForwardOut.features``); ``logit_rows``
        (int64 ``[R]``): return the logits of those token rows only (``[R, V]``; an EAGLE-3
        drafter then runs its LM head on those rows alone); ``top_k``: the caller reads only
        the ``top_k`` best log-probabilities per row, so a fused LM head may return those
        (``ForwardOut.top``) instead of the logits."""
        if hidden_rows is not None and hidden_in is None:
            raise ValueError("hidden_rows needs hidden_in")
        model, backend = self.model_of(role), self.backend_of(role)
        plain = hidden_in is None and not capture_layers
        runner = self.runners.get((id(model), batch.forward_mode)) if plain else None
        if runner is not None:
            out = ForwardOut(runner.run(batch, input_ids))
        else:
            if self._graph_mode:
                backend.init_forward_metadata_in_capture(batch)
            else:
                backend.init_forward_metadata(batch)
            if hidden_in is not None:  # an EAGLE-3 drafter: its LM head runs on logit_rows only
                hidden, logits = model.forward(input_ids, batch, backend, hidden_in, logit_rows=logit_rows,
                                               top_k=top_k, hidden_rows=hidden_rows)
                return ForwardOut(None, hidden, top=logits) if isinstance(logits, tuple) else ForwardOut(logits, hidden)
            return self._forward_plain(model, backend, input_ids, batch, capture_layers, logit_rows, top_k)
        if logit_rows is not None:
            out.logits = out.logits[logit_rows]
        return out

    @staticmethod
    def _forward_plain(model, backend, input_ids, batch, capture_layers, logit_rows, top_k) -> ForwardOut:
        if hasattr(model, "forward_logits"):
            logits, feats = model.forward_logits(input_ids, batch, backend, capture_layers=capture_layers,
                                                 logit_rows=logit_rows, top_k=top_k)
            if isinstance(logits, tuple):
                return ForwardOut(None, None, feats, top=logits)
            return ForwardOut(logits, None, feats)
        hidden, caps = model.forward(input_ids, batch, backend, capture_layers=capture_layers)
        logits = model.logits(hidden if logit_rows is None else hidden[logit_rows])
        return ForwardOut(logits, hidden, torch.cat(caps, -1) if caps else None)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 ``[N]`` tokens from float32 ``logits [N, V]`` under the current generation's
        sampling parameters (greedy: argmax); graph-safe."""
        return sample(logits, self.params, self.generator)

    @property
    def greedy_top_k(self) -> Optional[int]:
        """``top_k`` for a forward whose output only picks tokens (:meth:`next_tokens`,
        :meth:`verify_and_compact`): 1 when greedy (the LM head then returns the argmax
        without the logits), else None (sampling reads the logits)."""
        return 1 if self.params.greedy else None

    def next_tokens(self, out: ForwardOut) -> torch.Tensor:
        """int64 ``[N]`` tokens from a forward's output under the current sampling parameters
        (greedy: the argmax, from ``out.top`` when the forward had ``top_k=greedy_top_k``)."""
        return out.greedy_tokens() if self.params.greedy else self.sample(out.logits)

    def verify_and_compact(self, draft_tokens: torch.Tensor, tree: ops.TreeInfo, target: ForwardOut,
                           num_steps: int, out_cache_loc: torch.Tensor,
                           hidden_states: Optional[torch.Tensor] = None, chain: bool = False):
        """Greedy or lossless stochastic tree verify of ``draft_tokens [bs, n]`` against the
        target's forward over them (``target``: float32 ``logits [bs*n, V]``, or when greedy
        the argmax of a forward asked ``top_k=greedy_top_k``), then accepted-path
        compaction (tokens and, when given, ``hidden_states [bs*n, *]``) and one KV move for
        all target layers.  ``chain``: the tree is one chain in token order (``draft_tokens``
        column ``j`` at depth ``j``), so every accepted path is already at the front of its
        block and both are skipped (compaction would return its inputs, the move copy every
        slot onto itself).  Returns ``(CompactedPath, accept_length int32 [bs])``; device
        work only."""
        bs, n = draft_tokens.shape
        args = (draft_tokens, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling)
        if self.params.greedy:
            res = ops.verify_tree_greedy(*args, target.greedy_tokens().view(bs, n), num_steps)
        else:
            probs = logits_to_probs(target.logits, self.params).view(bs, n, -1)
            res = ops.tree_speculative_sampling(*args, probs, num_steps, generator=self.generator)
        if chain:
            return ops.CompactedPath(self.arange(bs * n), res.predicts, hidden_states, out_cache_loc,
                                     out_cache_loc, out_cache_loc), res.accept_length
        cp = ops.compact_accepted_path(res.accept_index, res.accept_length, out_cache_loc, n,
                                       predicts=res.predicts, hidden_states=hidden_states)
        # hazards stay within each request's block; slots are the engine's own: no checks
        self.target_pool.move_kv_cache(cp.tgt_loc, cp.src_loc, group_size=n, check_values=False)
        return cp, res.accept_length

    def commit(self, rb: RoundBatch, rows: torch.Tensor, prefix_lens: torch.Tensor, path: torch.Tensor,
               accept_length: torch.Tensor, also: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """Emit each request's accepted drafts + bonus (``path [bs, n]``, compacted, int32 or
        int64) into ``rb``, commit ``prefix_lens += accept_length + 1`` and make the bonus
        the new root (one :func:`ops.commit_accepted` launch); ``also``: up to 8 more
        ``(state [rows, ...], new values [bs, ...])`` pairs the strategy keeps per request
        row, written in one :func:`ops.scatter_rows` launch.  Device work only."""
        ops.commit_accepted(rows, self.prefix_lens, self.roots, prefix_lens, path.contiguous(), accept_length,
                            rb.emitted, check_values=False)
        if also:
            ops.scatter_rows(rows, list(also), check_values=False)

    # ------------------------------------------------------------------ driver
    def _prompt_ids(self, i: int, prompt) -> List[int]:
        """Prompt ``i``'s token ids as ints, or TypeError (a non-integer id: a float would be
        truncated) / ValueError (an id outside ``[0, vocab_size)``: a negative one would
        index the embedding from its end)."""
        try:
            ids = torch.as_tensor(prompt if isinstance(prompt, torch.Tensor) else list(prompt))
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"prompt {i} must be a sequence of int token ids") from None
        if ids.dim() != 1 or (ids.numel() and (ids.is_floating_point() or ids.is_complex()
                                                or ids.dtype == torch.bool)):
            raise TypeError(f"prompt {i} must be a sequence of int token ids, got {ids.dtype} "
                            f"{list(ids.shape)}")
        ids = ids.reshape(-1).long()
        V = self.target.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise ValueError(f"prompt {i} has token id {bad}, outside the vocabulary [0, {V})")
        return ids.tolist()

    def _margin(self, overlap: bool) -> int:
        """Positions past ``len(prompt) + max_new_tokens`` a request may touch: one round's
        tokens (two with the overlapped loop, which runs one round more) + 2."""
        return (2 if overlap else 1) * self.strategy.tokens_per_round + 2

    def _prefill(self, reqs: List[Request], defer: bool = False) -> Optional["_Admission"]:
        """The target's EXTEND over the prompts, the roots' sampling and the strategy's
        prefill: replaying a prefill graph when the engine has whole-round graphs, the
        strategy's prefill is device work (``Strategy.graph_prefill``) and the padded token
        count fits ``prefill_graph_tokens``; else eagerly.  Emits the roots, or with
        ``defer`` returns an :class:`_Admission` that emits them later (a replayed graph's
        roots then travel in a pinned copy: no host sync here)."""
        rows = [r.row for r in reqs]
        lens = [len(r.prompt) for r in reqs]
        T, bs = sum(lens), len(reqs)
        self.num_forward_target += 1
        pbs = next(s for s in padded_sizes(self.max_batch) if s >= bs)
        PT = padded_tokens(T + (pbs > bs))      # a padding request's last token is a padding one
        if self.prefill_graphs_on and self._graphs_can_sample(self.params) and PT <= self.prefill_graph_tokens:
            key = (pbs, PT, self._sampling_key(self.params))
            if key not in self.prefill_graphs:
                self._capture_prefill(pbs, PT, self.params)
            g, inp = self.prefill_graphs[key]
            host = torch.zeros(inp.shape[0], dtype=torch.int64)
            host[:T] = torch.tensor([t for r in reqs for t in r.prompt], dtype=torch.int64)
            host[PT:PT + T] = torch.cat([torch.arange(n) for n in lens])
            host[2 * PT:3 * PT] = self.dummy_row
            host[2 * PT:2 * PT + T] = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lens))
            tail = host[3 * PT:].view(3, pbs)
            tail[0] = self.dummy_row
            tail[0, :bs] = torch.tensor(rows)
            tail[1, :bs] = torch.tensor(lens)
            tail[2] = PT - 1
            tail[2, :bs] = torch.cumsum(torch.tensor(lens), 0) - 1
            inp.copy_(host.pin_memory(), non_blocking=True)
            g.replay()
            if defer:
                adm = _Admission(reqs, torch.empty(self.roots.shape[0], dtype=torch.int64).pin_memory(),
                                 torch.cuda.Event())
                adm.roots.copy_(self.roots, non_blocking=True)
                adm.event.record()
                return adm
            roots = self.roots.tolist()
            roots = [roots[r] for r in rows]
        else:
            dev = self.device
            rtt = self.req_pool.req_to_token
            ids = torch.tensor([t for r in reqs for t in r.prompt], dtype=torch.int64, device=dev)
            loc = torch.cat([rtt[r.row, :len(r.prompt)] for r in reqs]).long()
            batch = ForwardBatch.extend(rows, [0] * bs, lens, loc, device=dev)
            rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
            last = torch.cumsum(torch.tensor(lens, device=dev), 0) - 1
            token_rows = torch.repeat_interleave(rows_t, torch.tensor(lens, device=dev))
            roots = self._prefill_device(rows_t, ids, batch, last, token_rows, lens).tolist()
            if defer:
                by_row = torch.zeros(self.roots.shape[0], dtype=torch.int64)
                by_row[rows] = torch.tensor(roots, dtype=torch.int64)
                return _Admission(reqs, by_row, None)
        for r, t in zip(reqs, roots):
            self._emit(r, [t])
        return None

    def _emit_admission(self, adm: "_Admission") -> None:
        """Emit the roots of a deferred prefill (waiting for its copy)."""
        if adm.event is not None:
            adm.event.synchronize()
        for r in adm.reqs:
            self._emit(r, [int(adm.roots[r.row])])

    def _prefill_device(self, rows: torch.Tensor, ids: torch.Tensor, batch: ForwardBatch, last: torch.Tensor,
                        token_rows: torch.Tensor, lens: Optional[List[int]]) -> torch.Tensor:
        """Device work of a prefill (:class:`~specattn.spec_runtime.strategies.PrefillBatch`
        for the arguments); returns the roots, int64 ``[bs]``."""
        out = self.forward("target", ids, batch, capture_layers=self.strategy.target_capture_layers,
                           logit_rows=last, top_k=self.greedy_top_k)
        roots = self.next_tokens(out)
        self.prefix_lens[rows] = batch.extend_lens.long()
        self.roots[rows] = roots
        self.strategy.prefill(self, PrefillBatch(rows, ids, batch, out, last, token_rows, lens))
        return roots

    def _capture_prefill(self, pbs: int, PT: int, params: SamplingParams) -> None:
        """Capture a prefill of up to ``pbs`` requests and ``PT`` tokens under ``params``.  Its
        one static input, int64 ``[3 PT + 3 pbs]``: token ids, positions, token rows (``PT``
        each), then request rows, prompt lengths and last-token indices (``pbs`` each);
        captured with every request and token a padding one."""
        dev = self.device
        inp = torch.zeros(3 * PT + 3 * pbs, dtype=torch.int64, device=dev)
        inp[2 * PT:3 * PT] = self.dummy_row
        tail = inp[3 * PT:].view(3, pbs)
        tail[0] = self.dummy_row
        tail[2] = PT - 1
        ids, pos, token_rows = inp[:PT], inp[PT:2 * PT], inp[2 * PT:3 * PT]
        rows, lens, last = tail[0], tail[1], tail[2]
        zeros = self.constant(("prefill_prefix", pbs), lambda: torch.zeros(pbs, dtype=torch.int32, device=dev))

        def body():
            loc = self.req_pool.req_to_token[token_rows, pos].long()
            batch = ForwardBatch(ForwardMode.EXTEND, rows, zeros, lens.to(torch.int32), loc, pos)
            self._prefill_device(rows, ids, batch, last, token_rows, None)

        self.prefill_graphs[(pbs, PT, self._sampling_key(params))] = (self._capture(body, params), inp)

    def admission_due(self, running: int, free: int, waiting: int, rounds_held: int) -> bool:
        """Whether ``waiting`` (> 0) requests are prefilled into ``free`` (> 0) rows now, with
        ``running`` requests in flight and the first free row held for ``rounds_held``
        rounds: always with nothing running, else once ``min(min_free_slots, waiting)`` rows
        are free or after ``max_admission_delay`` rounds."""
        if running == 0 or free >= min(self.min_free_slots, waiting):
            return True
        return rounds_held >= self.max_admission_delay

    @staticmethod
    def rows_to_launch(running: Sequence[Request], in_flight: Sequence[Sequence[Request]],
                       unread_roots: Sequence[Request] = ()) -> List[Request]:
        """The requests of ``running`` the next round serves: all but those that the rounds
        in flight (``in_flight``: each one's requests, each round emitting at least one
        token per request) and their roots not yet read (``unread_roots``: requests of
        prefills whose roots the host has not emitted) surely finish by their token limit."""
        due = Counter(id(r) for snap in in_flight for r in snap)
        due.update(id(r) for r in unread_roots)
        return [r for r in running if len(r.output) + due[id(r)] < r.max_new_tokens]

    def _emit(self, req: Request, tokens: Sequence[int]) -> None:
        for t in tokens:
            req.output.append(int(t))
            if int(t) in self.eos:
                req.finished, req.finish_reason = True, "eos"
            elif len(req.output) >= req.max_new_tokens:
                req.finished, req.finish_reason = True, "length"
            if req.finished:
                return

    def _launch(self, rows: List[int], host: Optional[torch.Tensor], max_prefix: int):
        """Run one round for request ``rows`` (replaying a whole-round graph, or from the host)
        and start copying what it emits (``[count, tokens...]`` per request) to ``host``
        (pinned, with an event to wait for); on the CPU returns it directly.  ``max_prefix``:
        a bound of every request's prefix in this round."""
        bs = len(rows)
        if self.whole_round_graphs and self._graphs_can_sample(self.params):
            pbs = next(s for s in padded_sizes(self.max_batch) if s >= bs)
            bound = next((b for b in self.prefix_bounds() if b >= max_prefix), self.max_context)
            key = (pbs, self._sampling_key(self.params), bound)
            if key not in self.round_graphs:
                self._capture_round(pbs, self.params, bound)
            if self._rows_now != (pbs, rows):
                stage = torch.full((pbs,), self.dummy_row, dtype=torch.int64).pin_memory()
                stage[:bs] = torch.tensor(rows, dtype=torch.int64)
                self._static.rows[:pbs].copy_(stage, non_blocking=True)
                self._rows_now = (pbs, rows)
            self.round_graphs[key].replay()
            rb = RoundBatch(self._static.rows[:pbs], self._static.emitted[:pbs])
        else:
            rb = self._round_buffers(bs)
            rb.rows.copy_(torch.tensor(rows, dtype=torch.int64))
            if any(not self.backend_of(role).device_metadata for role, _ in self.strategy.round_modes()):
                rb.host_prefix_lens = self.prefix_lens[rb.rows].to("cpu", torch.int32)
            self.strategy.round(self, rb)
            self._reset_dummy()
        self.num_forward_target += 1
        if host is None:
            return rb.emitted[:bs], None
        host[:bs].copy_(rb.emitted[:bs], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = None,
                 progress=None, max_new_tokens: Optional[Sequence[int]] = None) -> GenerateResult:
        """Generate for every prompt; each request stops at EOS or its token limit
        (``max_new_tokens[i]`` if given, else ``params.max_new_tokens``).  Up to
        ``max_batch`` requests run at once; the others wait in order and each takes the row
        of a request that finished (continuous batching: its prefill runs between two
        rounds; with ``min_free_slots > 1`` several freed rows share one prefill).
        ``progress`` is called with the number of tokens generated so far before each
        round is queued (so a call may lag a round behind; the result holds the total).
        Stops: the engine's ``eos_token_ids`` only (a config's EOS ids apply when the caller
        passes them, as :func:`specattn.spec_runtime.cli.engine_for` does).

        Raises:
            ValueError: no prompts, an empty prompt, a token id outside the vocabulary, a
                prompt too long for ``max_context`` (with ``max_new_tokens`` and the positions
                one round may write past them), or bad ``max_new_tokens``.
            TypeError: ``prompts`` not a sequence, a prompt that is not a 1-D sequence of int
                ids (bools are not), a non-int limit, ``params`` not a SamplingParams.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise TypeError(f"prompts must be a sequence (a list) of prompts, got {type(prompts).__name__}")
        if max_new_tokens is not None and (isinstance(max_new_tokens, (str, bytes))
                                           or not hasattr(max_new_tokens, "__len__")):
            raise TypeError(f"max_new_tokens must be a sequence of per-prompt limits (or None: params' limit), "
                            f"got {max_new_tokens!r}")
        limits = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(prompts)
        if any(isinstance(m, bool) or not isinstance(m, numbers.Integral) for m in limits):
            raise TypeError(f"max_new_tokens must be ints, got {limits!r}")
        if len(limits) != len(prompts) or min(limits, default=1) < 1:
            raise ValueError("max_new_tokens needs one limit >= 1 per prompt")
        if not prompts:
            raise ValueError("no prompts")
        reqs = [Request(i, self._prompt_ids(i, p), row=-1, max_new_tokens=int(m))
                for i, (p, m) in enumerate(zip(prompts, limits))]
        empty = next((r for r in reqs if not r.prompt), None)
        if empty is not None:
            raise ValueError(f"prompt {empty.rid} is empty (a request needs at least one token)")
        need = max(len(r.prompt) + r.max_new_tokens for r in reqs)
        if need + self._margin(False) > self.max_context:
            r = next(r for r in reqs if len(r.prompt) + r.max_new_tokens + self._margin(False) > self.max_context)
            raise ValueError(f"prompt {r.rid}: length {len(r.prompt)} + max_new_tokens {r.max_new_tokens} "
                             f"+ {self._margin(False)} positions one round may write past them does not fit "
                             f"max_context {self.max_context}")
        overlap = (self.whole_round_graphs if self.overlap is None else self.overlap) and \
            need + self._margin(True) <= self.max_context
        self.params = params
        self.generator.manual_seed(params.seed if params.seed is not None else 0)
        self.num_forward_target = 0
        self._rows_now = None
        t0 = time.perf_counter()
        waiting, free, running = deque(reqs), list(range(self.max_batch)), []
        # admitted prefills whose roots are read with the first round launched after them
        # (no host sync at admission: the overlapped rounds keep the GPU busy meanwhile)
        admissions: deque = deque()
        n_admitted = 0
        held_since = None   # the round count when a free row first waited for others

        def admission_due() -> bool:
            nonlocal held_since
            if held_since is None:
                held_since = n_rounds
            return self.admission_due(len(running), len(free), len(waiting), n_rounds - held_since)

        def admit() -> None:  # waiting requests into free rows, prefilled together
            nonlocal n_admitted, held_since
            held_since = None
            while waiting and free:
                new = [waiting.popleft() for _ in range(min(len(waiting), len(free)))]
                for r in new:
                    r.row = free.pop(0)
                admissions.append((n_admitted, self._prefill(new, defer=True)))
                n_admitted += 1
                # a request of one token is done at its root: it joins no round
                running.extend(r for r in new if r.max_new_tokens > 1)

        def emit_roots(before: int) -> None:  # the roots of admissions numbered below `before`
            while admissions and admissions[0][0] < before:
                adm = admissions.popleft()[1]
                self._emit_admission(adm)
                free.extend(r.row for r in adm.reqs if r.max_new_tokens == 1)

        admit()
        # per round: [count, tokens...] of each request, copied to pinned memory (3 in rotation)
        host = [torch.zeros(self.max_batch, 1 + self.strategy.emit_width, dtype=torch.int64).pin_memory()
                for _ in range(3)] if self.device.type == "cuda" else None
        pending: deque = deque()
        n_rounds, k, waited = 0, 0, 0.0
        while running or pending or waiting or admissions:
            if waiting and free and admission_due():   # a row is reused after the rounds in flight
                admit()
            if progress is not None:
                progress(sum(len(r.output) for r in reqs))
            # a request the rounds in flight surely finish (each emits >= 1 token per row)
            # joins no further round: e.g. a length-limited request's last plain step
            launch = self.rows_to_launch(running, [snap for snap, _, _ in pending],
                                         [r for _, adm in admissions for r in adm.reqs]) \
                if running and len(pending) < (2 if overlap else 1) else []
            if launch:
                buf = host[k % 3] if host is not None else None
                k += 1
                # the device may be up to two rounds past what the host has read
                bound = max(len(r.prompt) + len(r.output) for r in launch) + 2 * self.strategy.tokens_per_round + 2
                pending.append((launch, n_admitted, self._launch([r.row for r in launch], buf, bound)))
                n_rounds += 1
                if overlap and len(pending) < 2:
                    continue
            if not pending:
                emit_roots(n_admitted)
                continue
            snap, before, (emitted, ev) = pending.popleft()
            if ev is not None:
                tw = time.perf_counter()
                ev.synchronize()
                waited += time.perf_counter() - tw
            emit_roots(before)     # their copies precede this round's: no extra wait
            for r, (c, *t) in zip(snap, emitted[:len(snap)].tolist()):   # the round's one read
                if r.finished:
                    continue
                if self.strategy.records_accept_length:
                    r.accept_lengths.append(c - 1)
                self._emit(r, t[:c])
            free += [r.row for r in running if r.finished]
            running = [r for r in running if not r.finished]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return GenerateResult([r.output for r in reqs], [r.finish_reason for r in reqs],
                              [r.accept_lengths for r in reqs], seconds, self.num_forward_target, n_rounds,
                              waited)
