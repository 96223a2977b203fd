"""Helpers shared by the KV-move tests of the CUDA and Triton implementations
(``test_kv_move_cuda.py``, ``test_kv_move_triton.py``)."""
from typing import List, Sequence

import torch

from specattn.ops import move_kv_cache_reference


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (uint8): compares NaN payloads and signed zeros exactly."""
    return t.contiguous().view(torch.uint8)


def random_buffers(num_buffers: int, num_slots: int, row_shape, dtype, gen: torch.Generator,
                   device) -> List[torch.Tensor]:
    """``num_buffers`` tensors ``[num_slots, *row_shape]`` of ``dtype`` on ``device`` with
    random bits in every byte (NaNs and infs included), drawn on the CPU from ``gen``."""
    size = torch.empty((), dtype=dtype).element_size()
    return [torch.randint(0, 256, (num_slots, *row_shape, size), generator=gen, dtype=torch.uint8)
            .view(dtype).view(num_slots, *row_shape).to(device) for _ in range(num_buffers)]


def replay_matches_reference(g: torch.cuda.CUDAGraph, bufs: Sequence[torch.Tensor],
                             tgt_loc: torch.Tensor, src_loc: torch.Tensor, tgt: List[int],
                             src: List[int]) -> None:
    """Write the moves ``tgt``/``src`` into the captured index tensors, replay ``g`` (a captured
    ``move_kv_cache(bufs, tgt_loc, src_loc)``) and assert every buffer equals, bit for bit,
    :func:`move_kv_cache_reference` applied to a copy taken before the replay."""
    tgt_loc.copy_(torch.tensor(tgt))
    src_loc.copy_(torch.tensor(src))
    expected = [b.clone() for b in bufs]
    move_kv_cache_reference(expected, tgt_loc, src_loc)
    g.replay()
    torch.cuda.synchronize()
    for got, exp in zip(bufs, expected):
        assert torch.equal(bits(got), bits(exp))
