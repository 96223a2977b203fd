"""Forward modes of a speculative-decoding step."""
from __future__ import annotations

import enum


class ForwardMode(enum.IntEnum):
    """What one forward computes (see :mod:`specattn.backends.forward_batch` for the tokens,
    positions and visibility of each mode).

    - ``EXTEND``: prefill; ``extend_lens[i]`` new tokens per request, causal.
    - ``DECODE``: one new token per request.
    - ``TARGET_VERIFY``: the target scores ``num_tokens_per_req`` draft-tree tokens per
      request (root first), each seeing the prefix plus its tree ancestors.
    - ``DRAFT_EXTEND_V2``: after verify, the drafter extends a *fixed* ``num_tokens_per_req``
      tokens per request (static shapes for CUDA graphs), causal.
    - ``IDLE``: no tokens (a rank with nothing to do still joins collective work).
    """

    EXTEND = 0
    DECODE = 1
    TARGET_VERIFY = 2
    DRAFT_EXTEND_V2 = 3
    IDLE = 4

    def is_decode(self) -> bool:
        """True for DECODE."""
        return self == ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        """True for TARGET_VERIFY (the only mode with a tree mask)."""
        return self == ForwardMode.TARGET_VERIFY

    def is_idle(self) -> bool:
        """True for IDLE (no tokens, no kernel)."""
        return self == ForwardMode.IDLE

    def is_cuda_graph(self) -> bool:
        """Modes whose shapes are fixed per padded batch size, hence capturable:
        DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2 and IDLE (EXTEND is variable-length)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                        ForwardMode.DRAFT_EXTEND_V2, ForwardMode.IDLE)

    def has_fixed_tokens_per_req(self) -> bool:
        """TARGET_VERIFY and DRAFT_EXTEND_V2 carry ``num_tokens_per_req``."""
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)
