"""CUDA-graph capture and replay of one model forward in one fixed-shape mode.

Per padded batch size the runner captures ``model.forward_logits(...)`` (or
``model.logits(model.forward(...))``) over static
inputs (:class:`~specattn.backends.GraphInputBuffers` + token ids).  ``run(batch, ids)`` copies
the live batch into the static buffers (padding the tail harmlessly), lets the backend write
the metadata into its static buffers (``init_forward_metadata_replay_cuda_graph``: device work,
plus a host-side plan where the backend's library needs one -- FlashInfer reads ``prefix_lens``
back and calls ``plan()``; torch_reference, triton and flashmla replay without a host sync)
and replays the smallest graph that fits.  All graphs share one memory pool.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from specattn.backends import ForwardBatch, ForwardMode, GraphInputBuffers, num_mask_words


def padded_sizes(max_bs: int) -> List[int]:
    """1, 2, 4, 8, 16, 24, 32, ... (steps of 8 past 16) up to and including ``max_bs``."""
    out, b = [], 1
    while b < max_bs:
        out.append(b)
        b = b * 2 if b < 16 else b + 8
    return out + [max_bs]


def padded_tokens(n: int) -> int:
    """The padded token count of a prefill graph for ``n`` tokens: the next of 32, 64, ..,
    512 (powers of two), then the next multiple of 512 (at most 1.5x the tokens past 512)."""
    b = 32
    while b < n and b < 512:
        b *= 2
    return b if b >= n else -(-n // 512) * 512


def empty_batch(mode: ForwardMode, tokens_per_req: int, device) -> ForwardBatch:
    """A batch of no requests in ``mode`` (what capture pads up from; with empty host
    lengths, so the padded capture batch carries host copies like every replay's)."""
    e64 = torch.zeros(0, dtype=torch.int64, device=device)
    e32 = torch.zeros(0, dtype=torch.int32, device=device)
    D = tokens_per_req
    return ForwardBatch(mode, e64, e32, e32.clone(), e64.clone(), e64.clone(),
                        num_tokens_per_req=D if mode.has_fixed_tokens_per_req() else None,
                        tree_mask=torch.zeros(0, D, num_mask_words(D), dtype=torch.int32, device=device)
                        if mode.is_target_verify() else None,
                        prefix_lens_cpu=torch.zeros(0, dtype=torch.int32),
                        extend_lens_cpu=torch.zeros(0, dtype=torch.int32))


class GraphRunner:
    """Graphs of ``model`` + ``backend`` in ``mode`` with ``tokens_per_req`` tokens per request
    (1 for DECODE) for every size in ``batch_sizes``.  The backend must already have had
    ``init_cuda_graph_state`` sized for the largest of its runners."""

    def __init__(self, model, backend, mode: ForwardMode, tokens_per_req: int,
                 batch_sizes: Sequence[int], pool=None):
        if not backend.supports(mode, graph=True, kind=backend.kind):
            raise ValueError(f"{backend.name} cannot capture {mode.name}")
        self.model, self.backend, self.mode, self.D = model, backend, mode, tokens_per_req
        self.sizes = sorted(batch_sizes)
        dev = model.device
        self.bufs = GraphInputBuffers(self.sizes[-1], tokens_per_req, dev)
        self.input_ids = torch.zeros(self.sizes[-1] * tokens_per_req, dtype=torch.int64, device=dev)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            self._capture(bs)

    def _forward(self, padded: ForwardBatch) -> torch.Tensor:
        ids = self.input_ids[:padded.num_tokens]
        if hasattr(self.model, "forward_logits"):   # the model's fused path, as the engine's eager one
            return self.model.forward_logits(ids, padded, self.backend)[0]
        hidden, _ = self.model.forward(ids, padded, self.backend)
        return self.model.logits(hidden)

    def _capture(self, bs: int) -> None:
        padded = self.bufs.fill(empty_batch(self.mode, self.D, self.model.device), bs)
        self.input_ids.zero_()
        self.backend.init_forward_metadata_capture_cuda_graph(padded)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(padded)  # warm-up (allocator, lazy init) outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outputs[bs] = self._forward(padded)
        self.graphs[bs] = g

    def run(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[T, vocab]`` of the live ``batch`` (``input_ids [T]``).

        Raises:
            ValueError: mode mismatch or batch larger than the largest captured size.
        """
        if batch.forward_mode != self.mode:
            raise ValueError(f"runner is for {self.mode.name}, batch is {batch.forward_mode.name}")
        bs, T = batch.batch_size, batch.num_tokens
        pbs = next((s for s in self.sizes if s >= bs), None)
        if pbs is None:
            raise ValueError(f"batch of {bs} exceeds the largest captured size {self.sizes[-1]}")
        padded = self.bufs.fill(batch, pbs)
        self.input_ids[:T].copy_(input_ids)
        self.input_ids[T:pbs * self.D].zero_()
        self.backend.init_forward_metadata_replay_cuda_graph(padded)
        self.graphs[pbs].replay()
        return self.outputs[pbs][:T]
