"""The paged-attention launchers (MHA ``paged_attention`` and ``mla_paged_attention``) refuse
metadata that would make the kernel follow an index out of range, before launching
(``check_bounds=True``, the default for direct callers): one violation at a time from a valid
call, each with its own message.  The valid call runs and writes every row (interpreter on a
CPU machine)."""
import os

import torch

if not torch.cuda.is_available():  # before triton / the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from specattn.backends import pack_tree_mask  # noqa: E402
from specattn.triton_kernels.attention import paged_attention  # noqa: E402
from specattn.triton_kernels.attention_mla import mla_paged_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
I32 = dict(dtype=torch.int32, device=DEV)


def valid():
    """bs 2 (rows 1 and 0 of a 2 x 8 req_to_token), 3 new tokens each, prefixes 4 and 0."""
    tree = pack_tree_mask(torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 3, 3).contiguous())
    return dict(q_rows=6, req_to_token=torch.arange(16, **I32).view(2, 8),
                req_pool_indices=torch.tensor([1, 0], device=DEV), prefix_lens=torch.tensor([4, 0], **I32),
                qo_indptr=torch.tensor([0, 3, 6], **I32), tree_mask=tree.to(DEV), max_q=3, num_splits=1)


def call(kind, a):
    a = dict(a)
    T = a.pop("q_rows")
    if kind == "mha":
        q = torch.randn(T, 2, 16, device=DEV)
        kc, vc = torch.randn(16, 1, 16, device=DEV), torch.randn(16, 1, 16, device=DEV)
        return paged_attention(q, kc, vc, a["req_to_token"], a["req_pool_indices"], a["prefix_lens"],
                               a["qo_indptr"], a["tree_mask"], a["max_q"], 0.25, num_splits=a["num_splits"])
    q = torch.randn(T, 2, 32, device=DEV)
    kv = torch.randn(16, 1, 32, device=DEV)
    return mla_paged_attention(q, kv, a["req_to_token"], a["req_pool_indices"], a["prefix_lens"],
                               a["qo_indptr"], a["tree_mask"], a["max_q"], 0.25, 16,
                               num_splits=a["num_splits"])


def _bad_slot(a):
    a["req_to_token"] = a["req_to_token"].clone()
    a["req_to_token"][0, 2] = 16    # request 1 (row 0) reads positions 0..2: one past the cache
    return a


MUTATIONS = {
    "more_than_max_q": (lambda a: {**a, "max_q": 2, "tree_mask": None}, "more than max_q = 2"),
    "row_out_of_range": (lambda a: {**a, "req_pool_indices": torch.tensor([2, 0], device=DEV)},
                         r"req_pool_indices must be in \[0, 2\)"),
    "negative_row": (lambda a: {**a, "req_pool_indices": torch.tensor([1, -1], device=DEV)},
                     r"req_pool_indices must be in \[0, 2\)"),
    "past_width": (lambda a: {**a, "prefix_lens": torch.tensor([6, 0], **I32)}, "past req_to_token's width 8"),
    "negative_prefix": (lambda a: {**a, "prefix_lens": torch.tensor([4, -1], **I32)}, "prefix_lens must be >= 0"),
    "slot_out_of_range": (_bad_slot, r"outside the cache's \[0, 16\)"),
    "indptr_not_from_0": (lambda a: {**a, "qo_indptr": torch.tensor([1, 3, 6], **I32)}, r"qo_indptr\[0\] must be 0"),
    "indptr_decreasing": (lambda a: {**a, "qo_indptr": torch.tensor([0, 4, 3], **I32), "tree_mask": None,
                                     "max_q": 4}, "non-decreasing"),
    "indptr_past_q": (lambda a: {**a, "qo_indptr": torch.tensor([0, 3, 7], **I32), "tree_mask": None,
                                 "max_q": 4}, "exceeds q's 6 rows"),
    "rows_without_request_when_split": (lambda a: {**a, "q_rows": 7, "num_splits": 2},
                                        "every row of q must belong to a request"),
}


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_out_of_range_metadata_is_refused(kind, mutation):
    mutate, msg = MUTATIONS[mutation]
    with pytest.raises(ValueError, match=msg):
        call(kind, mutate(valid()))


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_valid_metadata_runs(kind):
    out = call(kind, valid())
    assert out.shape[0] == 6 and torch.isfinite(out).all()
