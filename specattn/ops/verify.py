"""Verifying an EAGLE draft tree against the target: greedy and lossless stochastic.

Source of the semantics: ``sgl-kernel/csrc/speculative/eagle_utils.cu`` (``VerifyTreeGreedy``)
and ``sgl-kernel/csrc/speculative/speculative_sampling.cuh``
(``TreeSpeculativeSamplingTargetOnly``), called from
``python/sglang/srt/speculative/eagle_info.py`` / ``eagle_info_v2.py``
(``EagleVerifyInput.sample``).  Written from those semantics, not from their code.

Both walk the tree from the root (draft token 0, the last verified token) with the links of
:func:`specattn.ops.build_tree`; at each level they try the children of the last accepted
token in sibling order (ascending draft index) and move to the first one accepted; they stop
at a level where no child is accepted, at a leaf, or after ``num_steps`` accepted drafts.

Outputs (both ops; ``S = num_steps + 1``, ``D = num_draft_tokens``):

- ``accept_length``: int32 ``[bs]``, the number of accepted **draft** tokens, excluding the
  root and the bonus token: ``0 .. min(num_steps, tree depth)``.  This is what SGLang's
  kernels write to ``accept_token_num``.  The request emits ``accept_length + 1`` tokens and
  commits the KV of ``accept_length + 1`` tree tokens (root + accepted drafts).  NOTE: SGLang's
  spec-v2 ``EagleVerifyInputV2Mixin.sample`` adds 1 afterwards ("include the bonus token") and
  calls *that* ``accept_length``; ours is the kernel's count.
- ``accept_index``: int32 ``[bs, S]``: ``accept_index[b, 0] = retrive_index[b, 0]`` (the root),
  ``accept_index[b, k]`` the ``retrive_index`` (row in the flat ``[bs * D]`` arrays) of the
  ``k``-th accepted draft, ``-1`` after ``accept_length[b]``.
- ``predicts``: int32 ``[bs * D]``: ``predicts[accept_index[b, k]]`` is the token emitted after
  path token ``k``: the next accepted draft for ``k < accept_length``, the bonus token (target
  sample / argmax after the last accepted) for ``k = accept_length``.  The emitted tokens are
  ``predicts[accept_index[b, :accept_length[b] + 1]]``.  Every other entry is 0 (SGLang
  zero-fills ``predict`` before the kernel).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numbers
import numpy as np
import torch

from . import registry
from .checks import INDEX_DTYPES, capturing, check_fits_int32, check_index_range, check_tensor

__all__ = ["VerifyResult", "verify_tree_greedy", "verify_tree_greedy_reference",
           "tree_speculative_sampling", "tree_speculative_sampling_reference"]


class VerifyResult(NamedTuple):
    """Outputs of the verify ops (see the module docstring)."""

    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_length: torch.Tensor


def _children(nxt: list, sib: list, node: int, D: int):
    """The children of ``node`` in sibling order (raises on a cyclic sibling chain)."""
    c, seen = nxt[node], 0
    while c != -1:
        yield c
        seen += 1
        if seen > D:
            raise ValueError("retrive_next_sibling has a cycle")
        c = sib[c]


def verify_tree_greedy_reference(predicts, accept_index, accept_length, candidates,
                                 retrive_index, retrive_next_token, retrive_next_sibling,
                                 target_predict) -> None:
    """Plain-PyTorch reference of :func:`verify_tree_greedy` (argument order of SGLang's
    ``verify_tree_greedy`` op; ``num_steps = accept_index.shape[1] - 1``).  Inputs already
    validated; writes every element of ``predicts``, ``accept_index``, ``accept_length``."""
    bs, D = candidates.shape
    S = accept_index.shape[1]
    cand, ridx = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.flatten().tolist()  # indexed by retrive_index (flat rows)
    pred = [0] * (bs * D)
    acc = [[-1] * S for _ in range(bs)]
    n_acc = [0] * bs
    for b in range(bs):
        last, node = ridx[b][0], 0  # flat row / draft index of the last accepted token
        acc[b][0] = last
        while n_acc[b] < S - 1:
            hit = next((c for c in _children(nxt[b], sib[b], node, D)
                        if cand[b][c] == target[last]), None)
            if hit is None:
                break
            pred[last] = target[last]
            n_acc[b] += 1
            node, last = hit, ridx[b][hit]
            acc[b][n_acc[b]] = last
        pred[last] = target[last]  # the bonus token
    dev = predicts.device
    predicts.copy_(torch.tensor(pred, dtype=torch.int32, device=dev))
    accept_index.copy_(torch.tensor(acc, dtype=torch.int32, device=dev).view(bs, S))
    accept_length.copy_(torch.tensor(n_acc, dtype=torch.int32, device=dev))


def tree_speculative_sampling_reference(predicts, accept_index, accept_length, candidates,
                                        retrive_index, retrive_next_token, retrive_next_sibling,
                                        uniform_samples, uniform_samples_for_final_sampling,
                                        target_probs, threshold_single: float,
                                        threshold_acc: float, draft_probs=None) -> None:
    """Plain-PyTorch reference of :func:`tree_speculative_sampling` (argument order of
    SGLang's ``tree_speculative_sampling_target_only`` op, ``draft_probs`` moved last and
    optional, no ``deterministic`` flag).  Inputs already validated; writes every element of
    the outputs; never writes ``draft_probs`` (SGLang scribbles on it).

    The acceptance test is done in float32 in the kernels' order (sums in sibling order,
    IEEE division), so the kernels match it bit for bit.  The final draw inverts the
    cumulative sum of the float32 residual (torch's CPU ``cumsum``, which accumulates in
    double) at ``u = f32(coin) * f32(residual.sum())``: the first token whose residual is
    positive and whose cumulative sum exceeds ``u``; if none (``u`` at or above the last
    cumulative value: coin ~ 1 with rounding), the last token with a positive residual;
    ``V - 1`` if the residual is all zero (FlashInfer's fallback)."""
    bs, D = candidates.shape
    S, V = accept_index.shape[1], target_probs.shape[2]
    f32 = np.float32
    th_single, th_acc = f32(threshold_single), f32(max(threshold_acc, 1e-9))  # SGLang caps acc
    cand, ridx = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    coins, final_coins = uniform_samples.tolist(), uniform_samples_for_final_sampling.tolist()
    probs = target_probs.detach().cpu()
    dprobs = None if draft_probs is None else draft_probs.detach().cpu()
    pred = [0] * (bs * D)
    acc = [[-1] * S for _ in range(bs)]
    n_acc = [0] * bs
    for b in range(bs):
        last, node = ridx[b][0], 0  # q = probs[b, node] is the target's next-token law
        acc[b][0] = last
        rejected = []  # tokens of node's children rejected so far
        while n_acc[b] < S - 1:
            coin, prob_acc, hit = f32(coins[b][node]), f32(0.0), None
            for c in _children(nxt[b], sib[b], node, D):
                q = f32(probs[b, node, cand[b][c]].item())
                prob_acc = f32(prob_acc + q)
                if coin <= prob_acc / th_acc or q >= th_single:
                    hit = c
                    break
                rejected.append(cand[b][c])
            if hit is None:
                break
            pred[last] = cand[b][hit]
            n_acc[b] += 1
            node, last, rejected = hit, ridx[b][hit], []
            acc[b][n_acc[b]] = last
        # Bonus / correction token: sample relu(q - p) with p = draft_probs[b, node] (zeros
        # if None; also zeros after num_steps accepts: "no draft probs for the bonus token")
        # and p = q on the tokens of node's rejected children (SGLang writes them into p).
        residual = probs[b, node].clone()
        if dprobs is not None and n_acc[b] != S - 1:
            residual -= dprobs[b, node]
        residual[rejected] = 0.0
        residual = torch.where(residual > 0, residual, 0.0)     # relu; a NaN counts 0 (as fmaxf)
        u = f32(final_coins[b]) * f32(residual.sum().item())
        pos = residual > 0
        above = ((residual.cumsum(0) > float(u)) & pos).nonzero()
        if above.numel():
            pred[last] = int(above[0])
        elif bool(pos.any()):
            pred[last] = int(pos.nonzero()[-1])
        else:
            pred[last] = V - 1
    dev = predicts.device
    predicts.copy_(torch.tensor(pred, dtype=torch.int32, device=dev))
    accept_index.copy_(torch.tensor(acc, dtype=torch.int32, device=dev).view(bs, S))
    accept_length.copy_(torch.tensor(n_acc, dtype=torch.int32, device=dev))


registry.register("verify_tree_greedy", "reference", lambda: verify_tree_greedy_reference)
registry.register("tree_speculative_sampling", "reference",
                  lambda: tree_speculative_sampling_reference)


registry.register("verify_tree_greedy", "triton",
                  registry.from_module("specattn.triton_kernels.tree_ops", "verify_tree_greedy", "triton"))
registry.register("verify_tree_greedy", "cuda", registry.from_ext("verify_tree_greedy"))
registry.register("tree_speculative_sampling", "triton",
                  registry.from_module("specattn.triton_kernels.tree_sampling",
                                       "tree_speculative_sampling", "triton"))
registry.register("tree_speculative_sampling", "cuda",
                  registry.from_ext("tree_speculative_sampling"))


def _check_tree(candidates, retrive_index, retrive_next_token, retrive_next_sibling, num_steps):
    """Shared checks; returns ``(bs, D, device)``."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int):
        raise TypeError(f"num_steps must be an int, got {type(num_steps).__name__}")
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    check_tensor("candidates", candidates, dim=2, dtypes=INDEX_DTYPES)
    bs, D = candidates.shape
    dev = candidates.device
    if D < 1:
        raise ValueError("candidates must have at least one column (the root)")
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        check_tensor(name, t, dtypes=INDEX_DTYPES, device=dev, shape=(bs, D))
    check_index_range("retrive_index", retrive_index, bs * D)
    if not capturing() and bs > 0:
        # the kernels give each request its own block of the flat outputs
        own = (retrive_index.long() // D) == torch.arange(bs, device=dev)[:, None]
        if not bool(own.all()):
            b, j = (int(x) for x in (~own).nonzero()[0])
            raise ValueError(f"retrive_index[{b}, {j}] = {int(retrive_index[b, j])} is not a row "
                             f"of request {b}'s block [{b * D}, {b * D + D})")
    check_index_range("retrive_next_token", retrive_next_token, D, lower=-1)
    check_index_range("retrive_next_sibling", retrive_next_sibling, D, lower=-1)
    if not capturing() and bs > 0:
        # a tree links each node once (as a first child or as a next sibling) and the root never:
        # a second link (a pointer back to the node itself, an ancestor or the root) would let a
        # walk accept a node twice
        refs = torch.cat([retrive_next_token, retrive_next_sibling], dim=1).long()
        linked = torch.zeros(bs, D, dtype=torch.int64, device=dev).scatter_add_(1, refs.clamp(min=0),
                                                                                 (refs >= 0).long())
        linked[:, 0] += 1                                    # the root: any link to it is one too many
        if bool((linked > 1).any()):
            b, j = (int(x) for x in (linked > 1).nonzero()[0])
            raise ValueError(f"retrive_next_token / retrive_next_sibling of request {b} link "
                             f"{'the root' if j == 0 else f'node {j} twice'}: not a tree")
    return bs, D, dev


def _outputs(bs, D, num_steps, dev) -> VerifyResult:
    return VerifyResult(predicts=torch.empty(bs * D, dtype=torch.int32, device=dev),
                        accept_index=torch.empty(bs, num_steps + 1, dtype=torch.int32, device=dev),
                        accept_length=torch.empty(bs, dtype=torch.int32, device=dev))


def verify_tree_greedy(candidates: torch.Tensor, retrive_index: torch.Tensor,
                       retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                       target_predict: torch.Tensor, num_steps: int, *,
                       impl: str = "auto") -> VerifyResult:
    """Greedy tree verification (SGLang ``verify_tree_greedy``, ``eagle_utils.cu``).

    A child ``c`` of the last accepted token ``a`` is accepted when
    ``candidates[b, c] == target_predict.flatten()[retrive_index[b, a]]``; the first such
    child in sibling order wins (with distinct sibling tokens: the longest path of drafts that
    match the target's argmax, capped at ``num_steps``).  ``predicts`` along the path are the
    target's tokens; the bonus is the target's token after the last accepted one.

    Args:
        candidates: int32/int64 ``[bs, D]``: draft token ids, column 0 the root (SGLang's
            ``draft_token.reshape(bs, D)``).
        retrive_index, retrive_next_token, retrive_next_sibling: int32/int64 ``[bs, D]`` from
            :func:`specattn.ops.build_tree`; ``retrive_index[b]`` in request ``b``'s own
            block ``[b*D, b*D + D)`` (``build_tree`` gives ``b*D + j``), the links in
            ``[-1, D)``, forming a tree: each node linked at most once (as a first child or
            as a next sibling), the root never.
        target_predict: int32/int64 ``[bs, D]``: the target's argmax after each draft token,
            read at the flat row ``retrive_index[b, j]`` (as SGLang).
        num_steps: most drafts to accept (>= 0); ``accept_index`` gets ``num_steps + 1``
            columns (SGLang: ``spec_steps + 1``; NGRAM uses ``D``, i.e. ``num_steps = D-1``).
        impl: ``"auto"`` | ``"cuda"`` | ``"triton"`` | ``"reference"``.
    Returns:
        :class:`VerifyResult` ``(predicts int32 [bs*D], accept_index int32 [bs, num_steps+1],
        accept_length int32 [bs])`` (module docstring: accept_length excludes the bonus).
    Raises:
        TypeError / ValueError: wrong types, ranks, dtypes, shapes or devices; a cyclic
            sibling chain (reference); a ``retrive_index`` row outside its request's block;
            links that are not a tree (a node linked twice, or the root linked).
            IndexError: ``retrive_*`` out of range, or an int64 ``target_predict`` value
            outside int32 (``predicts`` is int32) (host syncs, skipped during CUDA-graph
            capture).
    """
    bs, D, dev = _check_tree(candidates, retrive_index, retrive_next_token,
                             retrive_next_sibling, num_steps)
    check_tensor("target_predict", target_predict, dtypes=INDEX_DTYPES, device=dev, shape=(bs, D))
    if target_predict.dtype == torch.int64:   # predicts holds them as int32
        check_fits_int32("target_predict", target_predict)
    out = _outputs(bs, D, num_steps, dev)
    if bs == 0:
        return out
    registry.dispatch("verify_tree_greedy", impl, dev)(
        *out, candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict)
    return out


def tree_speculative_sampling(candidates: torch.Tensor, retrive_index: torch.Tensor,
                              retrive_next_token: torch.Tensor,
                              retrive_next_sibling: torch.Tensor, target_probs: torch.Tensor,
                              num_steps: int, *, uniform_samples: Optional[torch.Tensor] = None,
                              uniform_samples_for_final_sampling: Optional[torch.Tensor] = None,
                              threshold_single: float = 1.0, threshold_acc: float = 1.0,
                              draft_probs: Optional[torch.Tensor] = None,
                              generator: Optional[torch.Generator] = None,
                              impl: str = "auto") -> VerifyResult:
    """Stochastic tree verification, lossless with the default thresholds and no
    ``draft_probs`` (SGLang ``tree_speculative_sampling_target_only``,
    ``speculative_sampling.cuh``; final draw as FlashInfer's ``DeviceSamplingFromProb``).

    "Target only": acceptance uses the target probabilities alone.  At the last accepted
    token ``a`` (target law ``q = target_probs[b, a]``, local draft index ``a``) with one coin
    ``u = uniform_samples[b, a]``, the children ``c_1, c_2, ..`` are tried in sibling order;
    ``c_i`` is accepted, and the walk moves to it, when

        ``u <= (q[tok(c_1)] + .. + q[tok(c_i)]) / threshold_acc``  or
        ``q[tok(c_i)] >= threshold_single``

    (float32, sums in sibling order, ``threshold_acc`` floored at 1e-9, exactly as SGLang; note
    ``u == 0`` accepts the first child even at ``q = 0``).  With both thresholds 1 and distinct
    sibling tokens this draws from ``q`` by inversion over the children, so child ``c`` is
    taken with probability ``q[tok(c)]``.

    Bonus / correction token, drawn at the last accepted token ``a`` from ``relu(q - p)``
    (renormalised) by inverting its cumulative sum at
    ``uniform_samples_for_final_sampling[b] * sum``: ``p = draft_probs[b, a]`` (zeros when
    ``draft_probs`` is None), except that ``p = 0`` after ``num_steps`` accepts (SGLang: "no
    draft probs for the bonus token") and ``p[t] = q[t]`` for the token ``t`` of every child
    of ``a`` rejected at ``a`` (SGLang writes those into its ``draft_probs`` buffer; this op
    never writes the caller's tensor); a NaN residual counts as 0.  The first token whose
    residual is positive and whose
    cumulative sum exceeds the target value is taken; if rounding leaves none (coin ~ 1), the
    last token with a positive residual; ``V - 1`` if the residual is all zero.  (SGLang's
    copy of FlashInfer's draw takes ``V - 1`` whenever no cumulative sum exceeds the target
    value, which can emit a zero-probability token when the coin is within rounding of 1;
    in exact arithmetic both rules pick the same token.)

    Lossless (every emitted token follows the target law) only with thresholds 1 and
    ``draft_probs`` None or zeros: the children are not drawn from ``draft_probs``, so a
    non-zero ``p`` makes the correction ``relu(q - p)`` wrong for this acceptance rule (SGLang's
    EAGLE sampling passes a zero buffer; ``draft_probs`` is here for parity with that op).
    Thresholds below 1 accept more, lossily.

    Deterministic mode (always on): the CUDA and Triton kernels use a fixed reduction order
    and no floating-point atomics (Triton: one program per request; CUDA: the vocabulary in
    fixed 8192-token tiles summed in tile order, split over several blocks per request that
    hand over with an integer ticket, so neither the split nor the finishing order changes a
    bit), so the same inputs and coins give the same outputs run to run and whatever else is
    in the batch (SGLang's ``deterministic=True``).  Passing
    both coin tensors makes the op fully deterministic.  Against the reference: acceptance
    decisions (hence ``accept_index``, ``accept_length`` and the accepted drafts in
    ``predicts``) are bit-exact (float32 sums in sibling order, IEEE division); the bonus
    token is exact up to float rounding at cdf boundaries: the kernels sum the vocabulary in
    parallel float32 tiles while the reference's CPU ``cumsum`` accumulates in double, so when
    ``u * sum`` lies within rounding (~1e-6 relative) of a cumulative-sum boundary the
    neighbouring token (also with a positive residual) may be chosen.  When every partial sum
    is exact (e.g. dyadic probabilities) the kernels equal the reference bit for bit.

    Args:
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, num_steps: as
            :func:`verify_tree_greedy`; ``candidates`` in ``[0, V)``.  The kernels assume, as
            SGLang and :func:`specattn.ops.build_tree`, ``retrive_index[b, :]`` in request
            ``b``'s own rows ``[b*D, b*D + D)``.
        target_probs: float32 ``[bs, D, V]``, stride 1 in the last dim:
            ``target_probs[b, j]`` the target's next-token distribution after draft token
            ``j`` (after temperature / top-k / top-p), indexed by the *local* draft index as
            in SGLang.  Not checked to be normalised (cost).
        uniform_samples: float32 ``[bs, D]`` in ``[0, 1]``, the coin used at each draft
            token (SGLang ``coins``); drawn with ``torch.rand(generator=generator)`` if None.
        uniform_samples_for_final_sampling: float32 ``[bs]`` in ``[0, 1]``, the coin of the
            bonus draw; drawn likewise if None.  Passing both makes the op deterministic.
        threshold_single, threshold_acc: floats in ``[0, 1]`` (SGLang
            ``speculative_accept_threshold_single`` / ``_acc``; 1.0 is lossless).
        draft_probs: optional float32 ``[bs, D, V]`` (stride 1 in the last dim), the draft
            model's distribution after each draft token, read only (see above; None means
            zeros, the lossless choice).
        generator: optional ``torch.Generator`` for the coins drawn here.
        impl: ``"auto"`` | ``"cuda"`` | ``"triton"`` | ``"reference"``.
    Returns:
        :class:`VerifyResult` as :func:`verify_tree_greedy` (``predicts`` along the path are
        the accepted drafts' tokens, at the end the bonus sample).
    Raises:
        TypeError / ValueError: wrong types, ranks, dtypes, shapes, strides or devices,
            thresholds outside ``[0, 1]``, coins outside ``[0, 1]``, a ``retrive_index`` row
            outside its request's block, links that are not a tree.  IndexError:
            ``retrive_*`` or ``candidates`` out of range.  Value checks are skipped during
            CUDA-graph capture.
    """
    bs, D, dev = _check_tree(candidates, retrive_index, retrive_next_token,
                             retrive_next_sibling, num_steps)
    check_tensor("target_probs", target_probs, dim=3, dtypes=(torch.float32,), device=dev)
    if tuple(target_probs.shape[:2]) != (bs, D) or target_probs.shape[2] < 1:
        raise ValueError(f"target_probs must have shape [{bs}, {D}, V >= 1], "
                         f"got {list(target_probs.shape)}")
    V = target_probs.shape[2]
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, dtypes=(torch.float32,), device=dev,
                     shape=(bs, D, V))
    for name, p in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if p is not None and V > 1 and p.stride(2) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dim (call .contiguous()), "
                             f"got strides {list(p.stride())}")
    for name, th in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if isinstance(th, bool) or not isinstance(th, numbers.Real):   # numpy floats are Real
            raise TypeError(f"{name} must be a real number in [0, 1], got {type(th).__name__}")
        if not 0.0 <= th <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {th!r}")
    threshold_single, threshold_acc = float(threshold_single), float(threshold_acc)
    check_index_range("candidates", candidates, V)
    if uniform_samples is not None:
        check_tensor("uniform_samples", uniform_samples, dtypes=(torch.float32,), device=dev,
                     shape=(bs, D))
    if uniform_samples_for_final_sampling is not None:
        check_tensor("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling,
                     dtypes=(torch.float32,), device=dev, shape=(bs,))
    if not capturing():
        for name, t in (("uniform_samples", uniform_samples),
                        ("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling)):
            if t is not None and t.numel() and not bool(((t >= 0) & (t <= 1)).all()):
                raise ValueError(f"{name} must lie in [0, 1]")
    if uniform_samples is None:  # drawn only once every input passed its checks
        uniform_samples = torch.rand(bs, D, generator=generator, device=dev)
    if uniform_samples_for_final_sampling is None:
        uniform_samples_for_final_sampling = torch.rand(bs, generator=generator, device=dev)
    out = _outputs(bs, D, num_steps, dev)
    if bs == 0:
        return out
    registry.dispatch("tree_speculative_sampling", impl, dev)(
        *out, candidates, retrive_index, retrive_next_token, retrive_next_sibling,
        uniform_samples, uniform_samples_for_final_sampling, target_probs,
        float(threshold_single), float(threshold_acc), draft_probs)
    return out
