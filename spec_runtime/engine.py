"""The step loop: target-only decoding and EAGLE (chain and tree) speculative decoding with
spec-v2 semantics, on any ``AttentionBackend`` (DFlash block drafting: :mod:`.dflash`).

One EAGLE round per running batch (``P`` = target KV committed, ``root`` = last emitted token,
whose target KV is not yet written; the drafter already holds ``root``'s KV and its logits):

1. draft: ``num_steps - 1`` DECODE steps over ``topk`` beams per request (each beam a scratch
   ``req_to_token`` row: prefix + root + its ancestors), scoring ``topk`` children per beam;
2. tree build (``specattn.ops.build_tree``) from the ``num_draft_tokens - 1`` best candidates;
3. TARGET_VERIFY over the ``D`` tree tokens at slots ``req_to_token[r, P : P + D]``;
4. verify (greedy or lossless speculative sampling) -> accepted drafts + bonus token;
5. accepted-path compaction + one KV move for all target layers;
6. DRAFT_EXTEND_V2 over a fixed ``min(num_steps, D-1) + 1`` tokens per request (accepted drafts,
   bonus, padding) at positions ``P+1 ..``: writes the drafter's KV and yields the bonus
   token's draft logits, which are the next round's first draft step;
7. commit ``P += accept_length + 1``, free the rest of the round's slots.

Each request keeps one ``req_to_token`` row; its KV slots are the same indices in the target's
and the drafter's pools.  Pages (``page_size``, 1 by default): a request's positions fill its
pages in order (position ``p`` at offset ``p % page_size``, ``KVAllocator.alloc_extend``), and a
round frees only the pages wholly past the new root.  EAGLE beams (scratch rows) share the
prefix's full pages; the page holding a beam's draft position is private to the beam, a fresh
page with the source beam's drafter KV copied in (one ``move_kv_cache`` for all drafter
layers per step), as SGLang copies the last partial page per beam when ``topk > 1``.

Backends: the target and the drafter each get their own instance of the one named backend
(``create_backend``, told the drafts' ``topk``: 1 for chains).  Nothing here is specific to a
backend: at construction the engine asks ``backend.supports(mode, graph=False, kind=...)`` for
every mode its algorithm runs on each model (:meth:`Engine.required_modes`); a mode the
backend lacks goes to the ``triton`` backend over the same pools when that one supports it
(:class:`~specattn.backends.RoutedBackend`, listed in :attr:`Engine.mode_routed`; e.g.
FlashInfer's missing MLA tree verify), else construction raises ``UnsupportedError`` naming
what is missing.  With ``cuda_graph=True`` it captures only the modes whose backend answers
``supports(mode, graph=True, ...)`` and runs the others eagerly (listed in
:attr:`Engine.eager_routed`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specattn import ops
from specattn.backends import (ForwardBatch, ForwardMode, KVAllocator, ReqToTokenPool, RoutedBackend,
                               UnsupportedError, create_backend)

from . import dflash
from .model import LlamaModel
from .sampling import SamplingParams, logits_to_probs, sample


@dataclass
class SpecConfig:
    """``algo``: ``none`` | ``eagle`` | ``dflash``.  EAGLE drafts ``num_steps`` levels with
    ``topk`` beams and verifies ``num_draft_tokens`` tokens (root included); ``topk = 1`` is a chain.  The
    default drafter is the target's first ``draft_layers`` layers + final norm + LM head
    (``None``: three quarters of the target's layers; early layers alone draft poorly: on
    SmolLM2-135M, 8 of 30 layers accept ~0.1 drafts per round, 24 of 30 ~0.8).  DFlash
    (:mod:`.dflash`) drafts ``block_size - 1`` tokens per round in one non-causal block forward
    of a random-init ``draft_layers``-layer drafter (``None``: 2) and verifies them as a chain."""

    algo: str = "none"
    topk: int = 1
    num_steps: int = 3
    num_draft_tokens: int = 4
    draft_layers: Optional[int] = None
    block_size: int = 16

    def validate(self) -> None:
        if self.algo not in ("none", "eagle", "dflash"):
            raise ValueError(f"unknown algo {self.algo!r}")
        if self.algo == "eagle":
            n_cand = self.topk + (self.num_steps - 1) * self.topk ** 2
            if self.topk < 1 or self.num_steps < 1 or not 2 <= self.num_draft_tokens <= n_cand + 1:
                raise ValueError(f"need topk >= 1, num_steps >= 1, 2 <= num_draft_tokens <= {n_cand + 1}")
        if self.algo == "dflash" and self.block_size < 2:
            raise ValueError(f"dflash needs block_size >= 2, got {self.block_size}")


@dataclass
class Request:
    rid: int
    prompt: List[int]
    row: int = -1
    P: int = 0                                  # target KV committed
    root: int = -1                              # last emitted token (KV not yet in the target)
    draft_logits: Optional[torch.Tensor] = None  # drafter's logits after root [V]
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

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens emitted per target verify (accepted drafts + bonus); 1.0 without spec."""
        rounds = [a for per in self.accept_lengths for a in per]
        return 1.0 + sum(rounds) / len(rounds) if rounds else 1.0


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
        max_batch, max_context: capacity (requests at once, tokens per request).
        page_size: KV page size of both pools (``max_context`` a multiple of it); e.g. 64 for
            FlashMLA.
        eos_token_ids: generation stops after emitting one of these.
        draft_model: EAGLE only: a separate drafter (same interface and vocabulary as the
            target, e.g. a small checkpoint loaded the same way) instead of the target's first
            ``draft_layers`` layers.
        cuda_graph: replay CUDA graphs for DECODE, TARGET_VERIFY and DRAFT_EXTEND_V2 (GPU
            only; captured at construction for padded batch sizes 1, 2, 4, .. up to the max).
            A mode the backend cannot capture (``supports(mode, graph=True)`` False) runs
            eagerly instead and is listed in :attr:`eager_routed`.

    Attributes:
        target_backend, draft_backend: the backends (``draft_backend`` only with a drafter).
        graph_modes: ``"target:DECODE"``-style names of the captured (model, mode) pairs.
        eager_routed: the same for modes run eagerly under ``cuda_graph=True`` because their
            backend cannot capture them.
        mode_routed: ``"target:TARGET_VERIFY->triton"``-style names of the modes the named
            backend lacks, run by the ``triton`` backend over the same pools.

    Raises:
        ValueError: bad ``spec``, ``draft_model``, ``page_size``, ``cuda_graph`` off CUDA, or
            a ``device`` other than the ready model's.
        KeyError, ImportError: from ``create_backend`` (unknown / unavailable backend).
        UnsupportedError: the backend does not support (eagerly) a mode the algorithm needs
            for the model's attention kind; the message names every missing (model, mode).
    """

    def __init__(self, config, weights: Optional[Dict[str, torch.Tensor]] = None, *, spec: SpecConfig = None,
                 backend: str = "torch_reference", device=None, dtype=torch.float32,
                 max_batch: int = 8, max_context: int = 1024, eos_token_ids: Sequence[int] = (),
                 cuda_graph: bool = False, draft_model=None, page_size: int = 1):
        self.spec = spec or SpecConfig()
        self.spec.validate()
        if page_size < 1 or max_context % page_size:
            raise ValueError(f"max_context ({max_context}) must be a multiple of page_size ({page_size})")
        self.eos = set(eos_token_ids)
        if weights is not None:
            self.target = LlamaModel(config, weights, "cpu" if device is None else device, dtype)
        else:  # a ready model brings its device (and dtype)
            self.target = config
            if device is not None and torch.empty(0, device=device).device != config.device:
                raise ValueError(f"device={device} differs from the ready model's {config.device}")
        self.device, self.dtype = self.target.device, self.target.dtype
        k = self.spec.topk if self.spec.algo == "eagle" else 0
        self.max_context, self.page_size = max_context, page_size
        self.req_pool = ReqToTokenPool(max_batch * (1 + 2 * k), max_context, self.device)
        # every request's pages + one private page per beam and draft step
        size = page_size * (max_batch * (max_context // page_size) + max_batch * max(1, k) * self.spec.num_steps)
        self.alloc = KVAllocator(size, page_size, self.device)
        self.mode_routed: List[str] = []
        roles = {}
        for role, mode in self.required_modes():
            roles.setdefault(role, []).append(mode)

        self.target_pool = self.target.make_kv_pool(size, page_size)
        topk = self.spec.topk if self.spec.algo == "eagle" else 1  # DFlash verifies a chain
        self.target_backend = self._make_backend(backend, "target", self.target_pool, roles["target"], topk)
        if self.spec.algo == "eagle":
            if draft_model is not None:
                if draft_model.vocab_size != self.target.vocab_size or draft_model.device != self.device:
                    raise ValueError("draft_model must share the target's vocabulary and device")
                self.draft = draft_model
            else:
                n = self.spec.draft_layers or max(1, 3 * self.target.num_layers // 4)
                self.draft = self.target.with_layers(n)
            self.draft_pool = self.draft.make_kv_pool(size, page_size)
            self.draft_backend = self._make_backend(backend, "draft", self.draft_pool, roles["draft"], topk)
        elif self.spec.algo == "dflash":  # block drafter whose context KV comes from target hidden states
            self.draft = dflash.DFlashDrafter(self.target, self.spec.draft_layers or 2, max_positions=max_context)
            self.draft_pool = self.draft.make_kv_pool(size, page_size)
            # its block forward is a TARGET_VERIFY with an all-ones (non-causal) mask: no chain promise
            self.draft_backend = self._make_backend(backend, "draft", self.draft_pool, roles["draft"], None)
        self._check_support()
        self.num_forward_target = 0
        self.runners = {}
        self.graph_modes: List[str] = []
        self.eager_routed: List[str] = []
        if cuda_graph:
            if self.device.type != "cuda":
                raise ValueError("cuda_graph needs a CUDA device")
            if self.spec.algo == "dflash":  # drafter graphs only: the verify returns hidden states
                dflash.capture_graphs(self, max_batch)
            else:
                self._capture_graphs(max_batch)

    # ------------------------------------------------------------------ backends
    def required_modes(self) -> List[Tuple[str, ForwardMode]]:
        """``(role, mode)`` for every forward this engine's algorithm runs, ``role`` in
        ``"target"``, ``"draft"``: the target's EXTEND (prefill) and DECODE (``none``) or
        TARGET_VERIFY (EAGLE, DFlash); the EAGLE drafter's EXTEND, DRAFT_EXTEND_V2 and DECODE
        (``num_steps > 1``); the DFlash drafter's TARGET_VERIFY (its block forward)."""
        sp = self.spec
        out = [("target", ForwardMode.EXTEND),
               ("target", ForwardMode.DECODE if sp.algo == "none" else ForwardMode.TARGET_VERIFY)]
        if sp.algo == "eagle":
            out += [("draft", ForwardMode.EXTEND), ("draft", ForwardMode.DRAFT_EXTEND_V2)]
            if sp.num_steps > 1:
                out.append(("draft", ForwardMode.DECODE))
        elif sp.algo == "dflash":
            out.append(("draft", ForwardMode.TARGET_VERIFY))
        return out

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

    def _backend_of(self, role: str):
        return self.target_backend if role == "target" else self.draft_backend

    def _check_support(self) -> None:
        """Raise ``UnsupportedError`` unless every required mode is supported eagerly."""
        missing = []
        for role, mode in self.required_modes():
            b = self._backend_of(role)
            if not b.supports(mode, graph=False, kind=b.kind):
                missing.append(f"{role} {mode.name} ({b.kind.name})")
        if missing:
            raise UnsupportedError(f"backend {self.target_backend.name!r} does not support "
                                   f"{', '.join(missing)} needed by algo {self.spec.algo!r}")

    def graph_plan(self, candidates) -> list:
        """Keep the ``(role, model, backend, mode, ...)`` entries whose backend can capture
        ``mode`` (``supports(mode, graph=True)``); record the rest in :attr:`eager_routed`."""
        keep = []
        for entry in candidates:
            role, _, backend, mode = entry[:4]
            if backend.supports(mode, graph=True, kind=backend.kind):
                keep.append(entry)
                self.graph_modes.append(f"{role}:{mode.name}")
            else:
                self.eager_routed.append(f"{role}:{mode.name}")
        return keep

    def _capture_graphs(self, max_batch: int) -> None:
        from .graph_runner import GraphRunner, padded_sizes
        sp, pool = self.spec, torch.cuda.graph_pool_handle()
        if sp.algo == "none":
            plan = [("target", self.target, self.target_backend, ForwardMode.DECODE, 1, max_batch)]
        else:
            L = min(sp.num_steps, sp.num_draft_tokens - 1) + 1
            plan = [("target", self.target, self.target_backend, ForwardMode.TARGET_VERIFY, sp.num_draft_tokens,
                     max_batch),
                    ("draft", self.draft, self.draft_backend, ForwardMode.DRAFT_EXTEND_V2, L, max_batch)]
            if sp.num_steps > 1:
                plan.append(("draft", self.draft, self.draft_backend, ForwardMode.DECODE, 1, max_batch * sp.topk))
        plan = [p[1:] for p in self.graph_plan(plan)]
        sizes = {}
        for model, backend, mode, D, bs in plan:  # one static state per backend, sized for all
            mb, mt = sizes.get(id(backend), (0, 0))
            sizes[id(backend)] = (max(mb, bs), max(mt, bs * D))
        for backend in {id(p[1]): p[1] for p in plan}.values():
            backend.init_cuda_graph_state(*sizes[id(backend)])
        for model, backend, mode, D, bs in plan:
            self.runners[(id(model), mode)] = GraphRunner(model, backend, mode, D, padded_sizes(bs), pool)

    # ------------------------------------------------------------------ helpers
    def _run(self, model, backend, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        runner = self.runners.get((id(model), batch.forward_mode))
        if runner is not None:
            return runner.run(batch, tokens)
        backend.init_forward_metadata(batch)
        hidden, _ = model.forward(tokens, batch, backend)
        return model.logits(hidden)

    def _tensor(self, x, dtype=torch.int64):
        return torch.as_tensor(x, dtype=dtype, device=self.device)

    def _emit(self, req: Request, tokens: Sequence[int], params: SamplingParams) -> None:
        for t in tokens:
            req.output.append(int(t))
            if int(t) in self.eos:
                req.finished, req.finish_reason = True, "eos"
            elif len(req.output) >= req.max_new_tokens:
                req.finished, req.finish_reason = True, "length"
            if req.finished:
                return

    def _release(self, req: Request) -> None:
        used = self.req_pool.req_to_token[req.row, :req.P + 1]
        self.alloc.free(used)
        self.req_pool.free([req.row])

    def _alloc(self, n: int) -> torch.Tensor:
        """``n`` slots filling fresh pages in order."""
        slots = self.alloc.alloc(n)
        if slots is None:
            raise RuntimeError(f"out of KV slots: need {n}, have {self.alloc.available_size()}")
        return slots

    def _grow(self, reqs: List[Request], n: int) -> torch.Tensor:
        """Slots for positions ``P+1 .. P+n`` of each request, continuing in the page of
        position ``P`` (int64 ``[len(reqs), n]``; one host read of the last slots)."""
        last = [-1] * len(reqs)
        if self.page_size > 1:
            rows, P = self._tensor([r.row for r in reqs]), self._tensor([r.P for r in reqs])
            last = self.req_pool.req_to_token[rows, P].tolist()
        slots = self.alloc.alloc_extend([r.P + 1 for r in reqs], [n] * len(reqs), last)
        if slots is None:
            raise RuntimeError(f"out of KV slots: need {n} per request, have {self.alloc.available_size()}")
        return slots.view(len(reqs), n)

    def _beam_slots(self, rows: torch.Tensor, src_rows: torch.Tensor,
                    pos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Scratch beam rows ``rows`` (copies of ``src_rows``) get a slot at position ``pos``
        each.  Pages > 1: the page holding ``pos`` becomes a fresh page per beam, with the
        drafter KV of the source's page copied in (its positions before ``pos``: prefix,
        root, ancestors), so the beams never write into a shared page.  Returns the slots
        (int64 ``[n]``) and every slot to free after drafting."""
        rtt, n, ps = self.req_pool.req_to_token, rows.numel(), self.page_size
        if ps == 1:
            slots = self._alloc(n)
            rtt[rows, pos] = slots.to(rtt.dtype)
            return slots, slots
        pages = self._alloc(n * ps).view(n, ps)                 # one fresh page per beam
        start = pos // ps * ps
        offs = torch.arange(ps, device=self.device)
        src_page = rtt[src_rows, start].long() // ps * ps      # pos == start: nothing to copy
        self.draft_pool.move_kv_cache(pages.flatten(), (src_page[:, None] + offs).flatten(),
                                      check_values=False)
        rtt[rows[:, None], start[:, None] + offs] = pages.to(rtt.dtype)
        return pages.gather(1, (pos - start)[:, None]).squeeze(1), pages.flatten()

    # ------------------------------------------------------------------ prefill
    def _prefill(self, reqs: List[Request], params: SamplingParams) -> None:
        rows = self.req_pool.alloc(len(reqs))
        if rows is None:
            raise RuntimeError("more requests than max_batch")
        lens = [len(r.prompt) for r in reqs]
        # each request gets its prompt's slots plus the root's slot (position P), in its own pages
        slots = self.alloc.alloc_extend([0] * len(reqs), [n + 1 for n in lens], [-1] * len(reqs))
        if slots is None:
            raise RuntimeError(f"out of KV slots: need {sum(lens) + len(reqs)} in whole pages, "
                               f"have {self.alloc.available_size()}")
        slots = slots.split([n + 1 for n in lens])
        for r, row, s in zip(reqs, rows, slots):
            r.row, r.P = row, len(r.prompt)
            self.req_pool.write(row, 0, s)
        ids = self._tensor([t for r in reqs for t in r.prompt])
        loc = torch.cat([s[:-1] for s in slots])
        batch = ForwardBatch.extend(rows, [0] * len(reqs), lens, loc, device=self.device)
        if self.spec.algo == "dflash":  # also captures the target layers the drafter's context KV needs
            logits = dflash.prefill_target(self, ids, batch)
        else:
            logits = self._run(self.target, self.target_backend, ids, batch)
        self.num_forward_target += 1
        last = torch.cumsum(self._tensor(lens), 0) - 1
        roots = sample(logits[last], params, self.generator).tolist()
        for r, t in zip(reqs, roots):
            r.root = t
            self._emit(r, [t], params)
        if self.spec.algo == "eagle":  # drafter: prompt + root, root's logits = first draft step
            ids = self._tensor([t for r in reqs for t in r.prompt + [r.root]])
            batch = ForwardBatch.extend(rows, [0] * len(reqs), [n + 1 for n in lens], torch.cat(slots),
                                        device=self.device)
            logits = self._run(self.draft, self.draft_backend, ids, batch)
            for r, i in zip(reqs, (last + torch.arange(1, len(reqs) + 1, device=self.device)).tolist()):
                r.draft_logits = logits[i]

    # ------------------------------------------------------------------ target-only
    def _decode_step(self, reqs: List[Request], params: SamplingParams) -> None:
        rows = [r.row for r in reqs]
        P = [r.P for r in reqs]
        loc = self.req_pool.req_to_token[self._tensor(rows), self._tensor(P)].long()
        batch = ForwardBatch.decode(rows, P, loc, device=self.device)
        logits = self._run(self.target, self.target_backend, self._tensor([r.root for r in reqs]), batch)
        self.num_forward_target += 1
        nxt = sample(logits, params, self.generator).tolist()
        new = self._grow(reqs, 1)[:, 0]
        for r, t, s in zip(reqs, nxt, new):
            r.P += 1
            self.req_pool.write(r.row, r.P, s[None])
            r.root = t
            self._emit(r, [t], params)

    # ------------------------------------------------------------------ EAGLE
    def _draft_tree(self, reqs: List[Request]):
        """Returns (parent_list [bs, K(S-1)+1], selected_index [bs, D-1], draft_tokens [bs, D])."""
        sp, bs, dev = self.spec, len(reqs), self.device
        K, S, D = sp.topk, sp.num_steps, sp.num_draft_tokens
        P = self._tensor([r.P for r in reqs])
        logp = torch.log_softmax(torch.stack([r.draft_logits for r in reqs]).float(), -1)
        beam_scores, beam_tokens = logp.topk(K, dim=-1)               # [bs, K]
        cand_scores, cand_tokens = [beam_scores], [beam_tokens]
        blocks = [torch.cat([torch.full((bs, 1), -1, device=dev, dtype=torch.int64),
                             torch.arange(K, device=dev).expand(bs, K)], 1)]
        rows = self.req_pool.alloc(2 * bs * K)
        bufs = [self._tensor(rows[:bs * K]).view(bs, K), self._tensor(rows[bs * K:]).view(bs, K)]
        rtt = self.req_pool.req_to_token
        real = self._tensor([r.row for r in reqs])
        src_rows = real[:, None].expand(bs, K)
        scratch = []
        for s in range(1, S):
            cur = bufs[s % 2]
            rtt[cur.flatten()] = rtt[src_rows.flatten()]               # prefix + root + ancestors
            pos = (P + s).repeat_interleave(K)
            slots, owned = self._beam_slots(cur.flatten(), src_rows.flatten(), pos)
            scratch.append(owned)
            host_pos = [r.P + s for r in reqs for _ in range(K)]  # host copy: no device read to plan
            batch = ForwardBatch.decode(cur.flatten(), host_pos, slots, device=dev)
            logits = self._run(self.draft, self.draft_backend, beam_tokens.flatten(), batch)
            lp = torch.log_softmax(logits, -1).view(bs, K, -1)
            child_scores, child_tokens = lp.topk(K, dim=-1)             # [bs, K, K]
            child_scores = beam_scores[..., None] + child_scores
            cand_scores.append(child_scores.flatten(1))
            cand_tokens.append(child_tokens.flatten(1))
            if s < S - 1:
                beam_scores, best = child_scores.flatten(1).topk(K, dim=-1)
                beam_tokens = child_tokens.flatten(1).gather(1, best)
                src_rows = cur.gather(1, best // K)
                blocks.append(K + (s - 1) * K * K + best)
        self.req_pool.free(rows)
        for sl in scratch:
            self.alloc.free(sl)
        scores, tokens = torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1)
        selected = scores.topk(D - 1, dim=-1).indices.sort(dim=-1).values
        parent_list = torch.cat(blocks, 1) if S > 1 else torch.full((bs, 1), -1, device=dev, dtype=torch.int64)
        draft_tokens = torch.cat([self._tensor([r.root for r in reqs])[:, None], tokens.gather(1, selected)], 1)
        return parent_list, selected, draft_tokens

    def _eagle_round(self, reqs: List[Request], params: SamplingParams) -> None:
        sp, bs, dev = self.spec, len(reqs), self.device
        K, S, D = sp.topk, sp.num_steps, sp.num_draft_tokens
        L = min(S, D - 1) + 1
        rows_t, P, out_cache_loc = self._open_round(reqs, D)
        rtt = self.req_pool.req_to_token
        parent_list, selected, draft_tokens = self._draft_tree(reqs)
        tree = ops.build_tree(parent_list, selected, P.to(torch.int32), K, S, D)
        host_P = [r.P for r in reqs]  # seq_lens from the host: batches carry seq_lens_cpu
        batch = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, rows_t, host_P, D, out_cache_loc,
                                   positions=tree.positions, tree_mask=tree.tree_mask, device=dev)
        logits = self._run(self.target, self.target_backend, draft_tokens.flatten(), batch)
        self.num_forward_target += 1
        cp, n_acc = self._verify_and_compact(draft_tokens, tree, logits, S, out_cache_loc, params)
        path = cp.predicts.view(bs, D).long()                          # accepted drafts + bonus first
        # drafter: accepted drafts + bonus (+ padding) at P+1 .., fixed L tokens per request
        ext_loc = rtt[rows_t[:, None], P[:, None] + 1 + torch.arange(L, device=dev)].long().flatten()
        batch = ForwardBatch.fixed(ForwardMode.DRAFT_EXTEND_V2, rows_t, [p + 1 for p in host_P], L, ext_loc,
                                   device=dev)
        dlogits = self._run(self.draft, self.draft_backend, path[:, :L].flatten(), batch).view(bs, L, -1)
        bonus_logits = dlogits[torch.arange(bs, device=dev), n_acc]
        self._commit_round(reqs, path, n_acc, D, params)
        for i, r in enumerate(reqs):
            r.draft_logits = bonus_logits[i]

    # ------------------------------------------------------------------ round pieces (EAGLE, DFlash)
    def _open_round(self, reqs: List[Request], n: int):
        """Allocate ``n`` slots per request for positions ``P+1 .. P+n`` (position ``P``, the
        root's, is held already).  Returns ``(rows int64 [bs], P int64 [bs], out_cache_loc
        int64 [bs*n])``: the slots of positions ``P .. P+n-1``, where the verify writes."""
        new = self._grow(reqs, n)
        for i, r in enumerate(reqs):
            self.req_pool.write(r.row, r.P + 1, new[i])
        rows, P = self._tensor([r.row for r in reqs]), self._tensor([r.P for r in reqs])
        cols = P[:, None] + torch.arange(n, device=self.device)
        return rows, P, self.req_pool.req_to_token[rows[:, None], cols].long().flatten()

    def _verify_and_compact(self, draft_tokens, tree, logits, num_steps: int, out_cache_loc,
                            params: SamplingParams, hidden_states=None):
        """Greedy or lossless stochastic tree verify of ``draft_tokens [bs, n]`` against the
        target's ``logits [bs*n, V]``, then accepted-path compaction and one KV move for all
        target layers.  Returns ``(CompactedPath, accept_length int64 [bs])``."""
        bs, n = draft_tokens.shape
        args = (draft_tokens, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling)
        if params.greedy:
            res = ops.verify_tree_greedy(*args, logits.argmax(-1).view(bs, n), num_steps)
        else:
            probs = logits_to_probs(logits, params).view(bs, n, -1)
            res = ops.tree_speculative_sampling(*args, probs, num_steps, generator=self.generator)
        cp = ops.compact_accepted_path(res.accept_index, res.accept_length, out_cache_loc, n,
                                       predicts=res.predicts, hidden_states=hidden_states)
        # hazards stay within each request's block; slots come from our allocator: no checks,
        # no host sync on the hot path
        self.target_pool.move_kv_cache(cp.tgt_loc, cp.src_loc, group_size=n, check_values=False)
        return cp, res.accept_length.long()

    def _commit_round(self, reqs: List[Request], path: torch.Tensor, n_acc: torch.Tensor, n: int,
                      params: SamplingParams) -> None:
        """Emit each request's accepted drafts + bonus (``path [bs, n]``, compacted), commit
        ``P += accept_length + 1``, make the bonus the new root and free the round's pages
        wholly past the new root's position."""
        rtt, ps = self.req_pool.req_to_token, self.page_size
        for i, r in enumerate(reqs):
            a = int(n_acc[i])
            r.accept_lengths.append(a)
            self._emit(r, path[i, :a + 1].tolist(), params)
            r.root = int(path[i, a])
            old_end = r.P + n
            r.P += a + 1
            keep = -(-(r.P + 1) // ps) * ps           # positions < keep share the root's pages
            if keep <= old_end:
                self.alloc.free(rtt[r.row, keep:old_end + 1])

    # ------------------------------------------------------------------ driver
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = None,
                 progress=None, max_new_tokens: Optional[Sequence[int]] = None) -> GenerateResult:
        """Generate for all prompts at once; each request stops at EOS or its token limit
        (``max_new_tokens[i]`` if given, else ``params.max_new_tokens``).  ``progress`` is
        called with the number of tokens generated so far after every step.

        Raises:
            ValueError: empty prompt or one too long for ``max_context``.
            RuntimeError: out of KV slots or request rows.
        """
        params = params or SamplingParams()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(params.seed if params.seed is not None else 0)
        limits = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(prompts)
        if len(limits) != len(prompts) or min(limits, default=1) < 1:
            raise ValueError("max_new_tokens needs one limit >= 1 per prompt")
        reqs = [Request(i, list(p), max_new_tokens=m) for i, (p, m) in enumerate(zip(prompts, limits))]
        margin = (self.spec.block_size if self.spec.algo == "dflash" else self.spec.num_draft_tokens) + 2
        for r in reqs:
            if not r.prompt or len(r.prompt) + r.max_new_tokens + margin > self.max_context:
                raise ValueError(f"prompt {r.rid}: length {len(r.prompt)} + max_new_tokens "
                                 f"{r.max_new_tokens} does not fit max_context {self.max_context}")
        self.num_forward_target = 0
        t0 = time.perf_counter()
        self._prefill(reqs, params)
        while True:
            for r in reqs:
                if r.finished and r.row >= 0:
                    self._release(r)
                    r.row = -1
            running = [r for r in reqs if not r.finished]
            if progress is not None:
                progress(sum(len(r.output) for r in reqs))
            if not running:
                break
            if self.spec.algo == "eagle":
                self._eagle_round(running, params)
            elif self.spec.algo == "dflash":
                dflash.dflash_round(self, running, params)
            else:
                self._decode_step(running, params)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return GenerateResult([r.output for r in reqs], [r.finish_reason for r in reqs],
                              [r.accept_lengths for r in reqs], time.perf_counter() - t0,
                              self.num_forward_target)
