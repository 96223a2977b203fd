"""``specattn bench e2e``: the main job measured end to end on the real model.

For every algorithm x batch size (default: target-only decoding, EAGLE chain, EAGLE tree,
DFlash, DDTree and n-gram at batch 1, 4, 16, 64; target-only and n-gram on the copy-heavy
set) the suite builds the runtime's engine on one GPU, in one process (CUDA graphs on, the
``triton`` backend, bf16 by default), runs every generation once untimed (warm-up: a new
prompt length can trigger a Triton compile), then times generations of the committed eval
prompts (``spec_runtime/data/eval_prompts.txt``, never used for training).  Batch size ``b``
serves ``n = b * max(1, min_requests // b, requests_per_row)`` requests, the prompt set in
order and cycled when it is shorter (``cycle_prompts=False``: rounded down to the set
instead, and a batch size above the set's size skipped), with up to ``max_new_tokens`` each
(a request ends after the model's end-of-turn token, as served; ``stop_at_eos=False`` makes
every request run the full length) through ``b`` request rows: one ``generate`` call whose
waiting prompts take the rows of finished requests (continuous batching), so batch 1
averages over the whole chat set (``min_requests`` 64) and a speculative batch does not
idle while its slowest request finishes (without the cycling, batch 64 over 64 prompts is
one wave, whose time is its longest request's).

One row per pair (the JSON's ``rows``):

- ``algo``, ``backend``, ``dtype``, ``bs``, ``config`` (the spec fields);
- ``tokens_per_s``: generated tokens / seconds of the timed generations (prefill included);
- ``accept_length``: tokens emitted per target verify, bonus included (1 without spec);
- ``step_ms``: wall time per round (a plain step, or a speculative round), prefill excluded
  (timed generations minus prefill-only generations of the same prompts, over the rounds);
- ``kernels_per_step`` and ``kernel_ms_per_step``: from a ``torch.profiler`` run of the first
  ``max(2, 2 b)`` prompts (after one unprofiled run of them), minus a profiled prefill-only
  run, over its rounds (every kernel, CUDA-graph replays included; memcpy/memset are not
  kernels); the kernel time is the time during which at least one kernel ran (kernels that
  overlap under programmatic dependent launch count once);
- ``profiled_step_ms``: wall time per round of those first prompts, timed unprofiled (their
  rounds are not the whole run's: the batch drains as they finish);
- ``gpu_busy``: ``kernel_ms_per_step / profiled_step_ms``, the share of a round's wall time
  during which a kernel ran, both from the same prompts;
- ``host_wait_ms_per_step``: how long per step the host loop sat waiting for a round's
  results (near ``step_ms``: the GPU is the bottleneck; near 0: the host is);
- ``retimed`` (only where it happened): a row whose timed rounds were long for its kernels
  (``kernel_ms_per_step / step_ms`` under ``retime_below_busy``: a host stall, the same
  kernels with longer gaps) is timed once more and keeps the faster of its two timings;
  ``retimed`` holds the first one's ``tokens_per_s`` and ``step_ms``, and the markdown lists
  such rows;
- ``speedup``: ``tokens_per_s`` over target-only decoding's at the same batch size;
- ``lossless``: ``"reference"`` for target-only decoding; ``"exact"`` when every output equals
  target-only decoding's in the same run; in bf16 / fp16 otherwise ``"near-greedy"`` when every
  emitted token is the float32 greedy choice up to the precision's near-ties
  (:mod:`specattn.spec_runtime.near_greedy`), else ``"FAIL"``.

Peers (``--peers``): HF transformers' ``generate`` with a static cache on the same weights
(``algo = "hf_static"``), greedy, same prompts and token counts, at batch sizes 1 and 16, in
consecutive static batches of ``b`` prompts (its ``generate`` has no continuous batching).

The JSON also holds ``device``, ``versions``, ``commit``, ``timestamp``, ``settings`` and
``ceilings`` (the bf16 matmul and copy ceilings, measured).  :func:`write_results` writes it
with a markdown table, which ends by naming the rows its settings planned but it lacks (a
run stopped early, e.g. by a time limit: :func:`unmeasured_rows`); :func:`render_png` draws
the bar chart (matplotlib, where installed: ``specattn bench plot FILE.json`` redraws it
from the JSON anywhere).
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

SUITE = "e2e"
DEFAULT_BATCH_SIZES = (1, 4, 16, 64)
DEFAULT_ALGOS = ("none", "eagle_chain", "eagle_tree", "dflash", "ddtree", "ngram")
ALGOS = DEFAULT_ALGOS
DEFAULT_REPETITIVE_ALGOS = ("none", "ngram")


@dataclass
class E2EConfig:
    """What one ``specattn bench e2e`` run measures (flags of the command)."""

    algos: Sequence[str] = DEFAULT_ALGOS
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES
    backend: str = "triton"
    dtype: str = "bfloat16"
    max_new_tokens: int = 128
    stop_at_eos: bool = True                # a request ends at the model's end-of-turn token(s)
    min_requests: int = 64                  # at least the chat set once at every batch size
    requests_per_row: int = 8               # prompts per request row (continuous batching)
    cycle_prompts: bool = True              # a set shorter than a batch size's requests repeats its prompts
    min_free_slots: Optional[int] = None    # Engine(min_free_slots=min(this, bs)); None: the engine's default
    chain: Dict[str, int] = field(default_factory=lambda: dict(topk=1, num_steps=5, num_draft_tokens=6))
    tree: Dict[str, int] = field(default_factory=lambda: dict(topk=4, num_steps=5, num_draft_tokens=32))
    # EAGLE tree: (min_batch, num_draft_tokens) pairs, smaller trees for large batches (DDTree: ddtree_by_batch)
    tree_by_batch: Sequence[Tuple[int, int]] = ((2, 16), (32, 8))
    block_size: int = 16
    # DFlash chain: (min_batch, block) pairs, a smaller block for large batches (SpecConfig)
    block_size_by_batch: Sequence[Tuple[int, int]] = ()
    # DFlash chain: (min_batch, tokens) pairs, verify only the block's first tokens (SpecConfig)
    dflash_verify_by_batch: Sequence[Tuple[int, int]] = ((4, 8), (16, 4))
    ddtree: Dict[str, int] = field(default_factory=lambda: dict(topk=8, num_draft_tokens=32))
    ddtree_by_batch: Sequence[Tuple[int, int]] = ((2, 16), (32, 8))
    ddtree_depth_decay: float = 0.8         # SpecConfig.ddtree_depth_decay
    ngram: Dict[str, int] = field(default_factory=lambda: dict(topk=4, num_steps=4, ngram_size=4))
    # n-gram: (min_batch, topk) pairs, fewer chains for large batches (SpecConfig: 1 + topk * num_steps tokens)
    ngram_topk_by_batch: Sequence[Tuple[int, int]] = ((16, 1),)
    drafter: Optional[str] = None           # EAGLE drafter folder (default: the shipped one)
    draft_vocab: Optional[int] = None       # EAGLE-3 and DFlash: draft from the N most frequent tokens (0: all;
                                            # None: drafter_base.default_draft_vocab_size of each drafter)
    dflash_drafter: Optional[str] = None    # DFlash drafter folder (default: the shipped one)
    prompts: Optional[str] = None           # prompt file (default: the chat eval set)
    repetitive_prompts: Optional[str] = None  # the copy-heavy set (default: the packaged one)
    repetitive_algos: Sequence[str] = DEFAULT_REPETITIVE_ALGOS  # run on that set (empty: skip it)
    peers: bool = True
    profile: bool = True
    retime_below_busy: float = 0.85         # re-time a row whose gpu_busy is under this (0: never)
    check: bool = True
    model: Optional[str] = None             # GGUF file or HF folder (default: SmolLM2-135M-Instruct)
    device: str = "cuda"                    # the bench is for GPUs; "cpu" only for tests


def spec_fields(algo: str, cfg: E2EConfig) -> dict:
    """The :class:`~specattn.spec_runtime.engine.SpecConfig` fields of a suite algorithm."""
    if algo == "none":
        return dict(algo="none")
    if algo == "eagle_chain":
        return dict(algo="eagle", **cfg.chain)
    if algo == "eagle_tree":
        return dict(algo="eagle", **cfg.tree, num_draft_tokens_by_batch=tuple(tuple(p) for p in cfg.tree_by_batch))
    if algo == "dflash":
        return dict(algo="dflash", block_size=cfg.block_size,
                    block_size_by_batch=tuple(tuple(p) for p in cfg.block_size_by_batch),
                    num_draft_tokens_by_batch=tuple(tuple(p) for p in cfg.dflash_verify_by_batch))
    if algo == "ddtree":
        return dict(algo="dflash", block_size=cfg.block_size, **cfg.ddtree,
                    num_draft_tokens_by_batch=tuple(tuple(p) for p in cfg.ddtree_by_batch),
                    ddtree_depth_decay=cfg.ddtree_depth_decay)
    if algo == "ngram":
        return dict(algo="ngram", **cfg.ngram, num_draft_tokens_by_batch=tuple(
            (m, 1 + k * cfg.ngram["num_steps"]) for m, k in cfg.ngram_topk_by_batch))
    raise ValueError(f"unknown algo {algo!r}; known: {', '.join(ALGOS)}")


_PATH_SETTINGS = ("drafter", "dflash_drafter", "prompts", "repetitive_prompts", "model")


def _drafter_record(folder) -> Optional[dict]:
    """``{"name", "sha256"}`` of a drafter folder: its name and the first 16 hex digits of the
    SHA-256 of its ``model.safetensors`` (which weights a run used); None without a folder."""
    if folder is None:
        return None
    weights = Path(folder) / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.is_file() else None
    return {"name": Path(folder).name, "sha256": digest}


def git_commit() -> Optional[str]:
    """``$SPECATTN_COMMIT`` if set (a machine without the repository's history), else
    ``git rev-parse HEAD`` of the package's checkout, else None."""
    env = os.environ.get("SPECATTN_COMMIT")
    if env:
        return env
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``: the results folder of a device."""
    low = name.lower()
    for key in ("h200", "h100", "h20", "b200", "a100", "l40s", "l4"):
        if key in low:
            return key
    return "".join(ch for ch in low if ch.isalnum())[:16] or "gpu"


# ---------------------------------------------------------------------- measurement
def busy_ms(intervals: Sequence[Tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals in microseconds, in
    milliseconds: the time at least one of them runs.  Kernels launched with programmatic
    dependent launch overlap their predecessor's tail, so summing their durations would
    count the overlap twice."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def _profile_kernels(fn: Callable[[], object]):
    """Run ``fn`` under ``torch.profiler``; returns ``(kernels launched, ms during which at
    least one kernel ran (:func:`busy_ms`), what fn returned)`` (no kernels without CUDA)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        res = fn()
        sync()
    copies = ("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA and not e.name.startswith(copies)]
    if spans or not torch.cuda.is_available():
        return len(spans), busy_ms(spans), res
    count, us = 0, 0.0          # a profiler without device events: the summed kernel times
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if dev_us and not e.key.startswith(copies):
            count, us = count + e.count, us + dev_us
    return count, us / 1e3, res


@dataclass
class _Timed:
    outputs: List[List[int]]
    tokens: int
    seconds: float
    rounds: int
    accept: float
    wait: float


def _run_batches(eng, batches, params, limits_fn) -> _Timed:
    outs, tokens, seconds, rounds, acc, wait = [], 0, 0.0, 0, [], 0.0
    for b in batches:
        res = eng.generate(b, params, max_new_tokens=limits_fn(b))
        outs += res.tokens
        tokens += res.num_tokens
        seconds += res.seconds
        rounds += res.num_rounds
        wait += res.wait_seconds
        acc += [a for per in res.accept_lengths for a in per]
    return _Timed(outs, tokens, seconds, rounds, 1.0 + sum(acc) / len(acc) if acc else 1.0, wait)


def _timing(eng, batches, params, full, one) -> Tuple[dict, _Timed]:
    """One timing: the generations, then the same prompts prefill-only.  Returns the row's
    timed fields and the timed generations."""
    timed = _run_batches(eng, batches, params, full)
    pre = _run_batches(eng, batches, params, one)
    rounds = max(timed.rounds - pre.rounds, 1)
    fields = dict(tokens=timed.tokens, seconds=timed.seconds, tokens_per_s=timed.tokens / timed.seconds,
                  accept_length=timed.accept, rounds=timed.rounds,
                  step_ms=(timed.seconds - pre.seconds) * 1e3 / rounds,
                  host_wait_ms_per_step=(timed.wait - pre.wait) * 1e3 / rounds)
    return fields, timed


def measure_engine(eng, batches: List[List[List[int]]], max_new_tokens: int, profile: bool,
                   retime_below_busy: float = 0.0):
    """Warm up, time, and (``profile``) profile ``eng`` on ``batches`` of prompts; with
    ``profile``, a ``gpu_busy`` under ``retime_below_busy`` times the row once more and keeps
    the faster timing (``row["retimed"]``: the first one's figures).  Returns ``(row,
    outputs)``: the row's measured fields (module docstring) and every request's generated
    tokens."""
    from specattn.spec_runtime.sampling import SamplingParams
    params = SamplingParams(max_new_tokens=max_new_tokens)
    full = lambda b: [max_new_tokens] * len(b)          # noqa: E731
    one = lambda b: [1] * len(b)                        # noqa: E731  prefill only
    # warm-up over EVERY batch: Triton specializes kernels on sizes (e.g. a prompt length
    # divisible by 16), so a prompt length not yet seen compiles inside a timed run
    _run_batches(eng, batches, params, full)
    _run_batches(eng, batches, params, one)
    fields, timed = _timing(eng, batches, params, full, one)
    step_ms = fields["step_ms"]
    row = dict(fields, kernels_per_step=None, kernel_ms_per_step=None, gpu_busy=None)
    if profile:  # on the first prompts only (a profiled kernel costs host time to record)
        sub = [[p for b in batches for p in b][:max(2, 2 * eng.max_batch)]]
        _run_batches(eng, sub, params, full)          # any graph this subset's shapes need
        sub_fields, _ = _timing(eng, sub, params, full, one)
        k_full, ms_full, t_full = _profile_kernels(lambda: _run_batches(eng, sub, params, full))
        k_pre, ms_pre, t_pre = _profile_kernels(lambda: _run_batches(eng, sub, params, one))
        n = max(t_full.rounds - t_pre.rounds, 1)
        row["kernels_per_step"] = (k_full - k_pre) / n
        row["kernel_ms_per_step"] = kernel_ms = (ms_full - ms_pre) / n
        row["profiled_step_ms"] = sub_step = sub_fields["step_ms"]
        row["gpu_busy"] = kernel_ms / sub_step if sub_step > 0 else None
        if step_ms > 0 and kernel_ms / step_ms < retime_below_busy:
            first = {k: row[k] for k in ("tokens_per_s", "step_ms")}
            again, _ = _timing(eng, batches, params, full, one)
            if again["step_ms"] < step_ms:
                row.update(again)
            row["retimed"] = first
    return row, timed.outputs


def response_tokens(rows: List[List[int]], eos_token_ids: Sequence[int]) -> List[List[int]]:
    """Each row cut right after its first token in ``eos_token_ids`` (kept whole without one):
    the tokens a request that stops at its end token emits (a static batch pads after it)."""
    eos = set(eos_token_ids)
    cut = []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        cut.append(row[:end])
    return cut


def _hf_static(model_path: str, dtype: torch.dtype, batches, max_new_tokens: int,
               eos_token_ids: Sequence[int] = ()) -> Optional[dict]:
    """HF transformers' greedy ``generate`` with a static cache (left-padded batches).  With
    ``eos_token_ids`` a row's tokens are counted up to and including its first end token (the
    batch runs until every row has one); without, every row makes ``max_new_tokens``."""
    from specattn.spec_runtime import loader
    hf = loader.load_hf_oracle(model_path, dtype).to("cuda")
    hf.generation_config.pad_token_id = hf.generation_config.eos_token_id

    def run(batch):
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stop = (dict(eos_token_id=list(eos_token_ids)) if eos_token_ids
                else dict(min_new_tokens=max_new_tokens))
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          do_sample=False, cache_implementation="static", **stop)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return sum(map(len, response_tokens(out[:, width:].tolist(), eos_token_ids))), seconds

    for b in batches:  # warm-up over every batch, as for the engine
        run(b)
    tokens, seconds = 0, 0.0
    for b in batches:
        n, s = run(b)
        tokens, seconds = tokens + n, seconds + s
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, accept_length=1.0)


def run_e2e(cfg: E2EConfig, progress: Optional[Callable[[str], None]] = None,
            on_row: Optional[Callable[[dict], None]] = None) -> dict:
    """Measure every ``(algo, bs)`` of ``cfg`` (module docstring); returns the JSON report.
    ``progress`` gets one line per phase; ``on_row`` gets the report so far after every row
    (the command writes it, so a run stopped by a time limit keeps what it measured).

    Raises:
        RuntimeError: no CUDA GPU.  ValueError: an unknown algo or an empty prompt file.
    """
    from specattn.bench import harness
    from specattn.bench.runner import device_summary
    from specattn.info import module_version
    from specattn.spec_runtime import loader
    from specattn.spec_runtime.cli import (DTYPES, default_drafter, eval_prompts_path,
                                           eval_repetitive_prompts_path, load_model)
    from specattn.spec_runtime.engine import Engine, SpecConfig
    from specattn.spec_runtime.model import LlamaModel
    import specattn

    if cfg.device.startswith("cuda"):
        harness.require_cuda()
    say = progress or (lambda msg: None)
    for a in cfg.algos:
        spec_fields(a, cfg)
    for a in cfg.repetitive_algos:
        spec_fields(a, cfg)
    dtype = DTYPES[cfg.dtype]

    def read(path) -> List[str]:
        texts = [l for l in Path(path).read_text().splitlines() if l.strip()]
        if not texts:
            raise ValueError(f"the prompt file {path} is empty")
        return texts

    sets = {"chat": (read(cfg.prompts or eval_prompts_path()), list(cfg.algos))}
    if cfg.repetitive_algos:
        sets["repetitive"] = (read(cfg.repetitive_prompts or eval_repetitive_prompts_path()),
                              list(cfg.repetitive_algos))
    cfg_model, weights, tok = load_model(cfg.model, dtype)
    target = LlamaModel(cfg_model, weights, cfg.device, dtype)
    drafter_path = cfg.drafter or default_drafter(cfg_model)
    dflash_path = cfg.dflash_drafter or default_drafter(cfg_model, "dflash")
    from specattn.spec_runtime.drafter_base import default_draft_vocab_size
    draft_vocab, dflash_vocab = cfg.draft_vocab, cfg.draft_vocab
    if draft_vocab is None and drafter_path is not None:
        draft_vocab = default_draft_vocab_size(drafter_path)
    if dflash_vocab is None and dflash_path is not None:
        dflash_vocab = default_draft_vocab_size(dflash_path)
    eos_ids = tuple(cfg_model.eos_token_ids) if cfg.stop_at_eos else ()
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    say("measuring the ceilings")
    ceilings = harness.measure_ceilings() if cfg.device.startswith("cuda") else None
    rows: List[dict] = []
    report = {
        "suite": SUITE,
        "device": device_summary() if cfg.device.startswith("cuda") else {"name": "cpu"},
        "versions": {"specattn": specattn.__version__, "torch": torch.__version__,
                     "triton": module_version("triton"), "cuda": torch.version.cuda,
                     "transformers": module_version("transformers")},
        "commit": git_commit(),
        "timestamp": stamp,
        # files by name: a results file names no machine's paths (the drafters' weights by digest)
        "settings": {k: (Path(v).name if k in _PATH_SETTINGS and v is not None else v)
                     for k, v in asdict(cfg).items()},
        "drafters": {"eagle": _drafter_record(drafter_path), "dflash": _drafter_record(dflash_path)},
        "ceilings": asdict(ceilings) if ceilings is not None else None,
        "model": "SmolLM2-135M-Instruct" if cfg.model is None else Path(cfg.model).name,
        "num_prompts": {name: len(texts) for name, (texts, _) in sets.items()},
        "rows": rows,
    }

    def add(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(report)

    # batch sizes outermost, prompt sets inside: a run stopped by a time limit keeps every
    # set's small-batch rows
    set_ids = {name: [loader.apply_chat_template(tok, t) for t in texts] for name, (texts, _) in sets.items()}
    base_out: Dict[Tuple[str, int], List[List[int]]] = {}
    base_tps: Dict[Tuple[str, int], float] = {}
    for bs, set_name in ((bs, name) for bs in cfg.batch_sizes for name in sets):
        ids_all, algos = set_ids[set_name], sets[set_name][1]
        n_batches = max(1, cfg.min_requests // bs, cfg.requests_per_row)
        if not cfg.cycle_prompts:
            n_batches = min(n_batches, len(ids_all) // bs)
            if n_batches < 1:
                say(f"{set_name}: batch size {bs} needs {bs} prompts, the set has {len(ids_all)}: skipped")
                continue
        ids = [ids_all[i % len(ids_all)] for i in range(n_batches * bs)]   # the set cycled when shorter
        batches = [ids[i * bs:(i + 1) * bs] for i in range(n_batches)]   # (HF static: one by one)
        longest = max(len(p) for b in batches for p in b)
        for algo in algos:
            fields = spec_fields(algo, cfg)
            spec = SpecConfig(**fields)
            ctx = -(-(longest + cfg.max_new_tokens + 2 * spec.tokens_per_round() + 8) // 64) * 64
            draft = None
            if spec.algo == "eagle" and drafter_path is not None:
                from specattn.spec_runtime.eagle3 import Eagle3Drafter
                draft = Eagle3Drafter.load(drafter_path, target, draft_vocab_size=draft_vocab or None)
            elif spec.algo == "dflash" and dflash_path is not None:
                from specattn.spec_runtime.dflash import DFlashDrafter
                draft = DFlashDrafter.load(dflash_path, target, draft_vocab_size=dflash_vocab or None)
            tag = f"{set_name} {algo} bs={bs}"
            say(f"{tag}: building the engine (CUDA graphs)")
            row_start = time.perf_counter()
            eng = Engine(target, spec=spec, backend=cfg.backend, max_batch=bs, max_context=ctx,
                         eos_token_ids=eos_ids, cuda_graph=cfg.device.startswith("cuda"), draft_model=draft,
                         min_free_slots=None if cfg.min_free_slots is None else min(cfg.min_free_slots, bs))
            say(f"{tag}: warm-up, timing" + (", profiling" if cfg.profile else ""))
            row, outs = measure_engine(eng, [[p for b in batches for p in b]], cfg.max_new_tokens, cfg.profile,
                                       cfg.retime_below_busy)
            row.update(algo=algo, prompt_set=set_name, backend=cfg.backend, dtype=cfg.dtype, bs=bs,
                       requests=len(ids), config=fields,
                       drafter=(Path(dflash_path if spec.algo == "dflash" else drafter_path).name
                                if draft is not None else
                                ("self-speculative" if spec.algo == "eagle" else
                                 ("random-init" if spec.algo == "dflash" else None))),
                       draft_vocab=((draft_vocab if spec.algo == "eagle" else dflash_vocab) or None)
                       if draft is not None else None,
                       whole_round_graphs=eng.whole_round_graphs, min_free_slots=eng.min_free_slots)
            if algo == "none":
                base_out[set_name, bs], base_tps[set_name, bs] = outs, row["tokens_per_s"]
                row["lossless"] = "reference"
            elif cfg.check and (set_name, bs) in base_out:
                row["lossless"] = _lossless(outs, base_out[set_name, bs], [p for b in batches for p in b],
                                            cfg_model, weights, dtype, cfg.device)
            else:
                row["lossless"] = None
            row["speedup"] = row["tokens_per_s"] / base_tps[set_name, bs] if (set_name, bs) in base_tps else None
            add(row)
            say(f"{tag}: {row['tokens_per_s']:.1f} tokens/s, accept {row['accept_length']:.2f} "
                f"(the row took {time.perf_counter() - row_start:.0f} s)")
            del eng, draft
            gc.collect()
            if cfg.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if cfg.peers and set_name == "chat" and bs in (1, 16) and cfg.model is None:
            say(f"hf_static bs={bs}")
            try:
                from specattn.spec_runtime.model_fetch import fetch_model
                hf = _hf_static(str(fetch_model()), dtype, batches, cfg.max_new_tokens, eos_ids)
                hf.update(algo="hf_static", prompt_set=set_name, backend="transformers", dtype=cfg.dtype,
                          bs=bs, config={}, lossless=None,
                          speedup=hf["tokens_per_s"] / base_tps[set_name, bs] if (set_name, bs) in base_tps else None)
                add(hf)
            except Exception as e:  # a peer that cannot run is reported, not fatal
                add(dict(algo="hf_static", prompt_set=set_name, backend="transformers", dtype=cfg.dtype,
                         bs=bs, error=f"{type(e).__name__}: {e}"))
    return report


def _lossless(outs, base, prompts, cfg_model, weights, dtype, device) -> str:
    if outs == base:
        return "exact"
    if dtype == torch.float32:
        return "FAIL"
    from specattn.spec_runtime.model import LlamaModel
    from specattn.spec_runtime.near_greedy import near_greedy
    w32 = {k: v.float() for k, v in weights.items()}
    m32 = LlamaModel(cfg_model, w32, device, torch.float32, fused=False)
    mlow = LlamaModel(cfg_model, dict(weights), device, dtype, fused=False)
    bad = [i for i, (a, b) in enumerate(zip(outs, base)) if a != b]
    res = near_greedy(m32, mlow, [prompts[i] for i in bad], [outs[i] for i in bad])
    del w32, m32, mlow
    return "near-greedy" if res.max_ratio <= 1.0 and res.vocab_share <= 0.1 else "FAIL"


# ---------------------------------------------------------------------- output
def _prompt_counts(report: dict) -> str:
    n = report["num_prompts"]
    if isinstance(n, int):
        return f"{n} eval prompts"
    out = ", ".join(f"{v} {k} prompts" for k, v in n.items())
    st = report.get("settings") or {}
    if st.get("cycle_prompts") and st.get("requests_per_row"):
        least = f"at least {st['min_requests']} requests per batch size and " if st.get("min_requests") else ""
        out += f" ({least}{st['requests_per_row']} per request row, a set cycled where it is shorter)"
    return out


def _cell(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _from_batch(pairs) -> str:
    """``[[2, 16], [32, 8]]`` -> ``", 16 from batch 2, 8 from batch 32"``."""
    return "".join(f", {v} from batch {m}" for m, v in pairs or [])


def _eagle_settings(report: dict) -> str:
    """" EAGLE chain / tree (topk, num_steps, num_draft_tokens)[, tree tokens by batch][, draft
    vocabulary]." or ""."""
    st = report.get("settings") or {}
    if "chain" not in st or not any(r.get("algo", "").startswith("eagle") for r in report["rows"]):
        return ""
    fmt = lambda c: f"({c['topk']}, {c['num_steps']}, {c['num_draft_tokens']})"   # noqa: E731
    dv = next((r["draft_vocab"] for r in report["rows"] if r.get("draft_vocab") and r["algo"].startswith("eagle")),
              None)
    by_batch = f" (tree tokens {st['tree']['num_draft_tokens']}{_from_batch(st['tree_by_batch'])})" \
        if st.get("tree_by_batch") else ""
    return (f" EAGLE chain {fmt(st['chain'])}, tree {fmt(st['tree'])} (topk, num_steps, num_draft_tokens)"
            + by_batch + (f", drafting from the {dv:,} most frequent tokens." if dv else "."))


def _dflash_ngram_settings(report: dict) -> str:
    """" DFlash chain: block 16, 4 from batch 16.  DDTree: topk 8, 32 tokens, 16 from batch 2.
    N-gram: 4 chains of 4 (...), 1 from batch 16." or "" (no such rows)."""
    st = report.get("settings") or {}
    algos = {r.get("algo") for r in report["rows"]}
    out = ""
    if "block_size_by_batch" in st and "dflash" in algos:   # (reports from before the per-batch block say nothing)
        out += f" DFlash chain: block {st['block_size']}{_from_batch(st.get('block_size_by_batch'))}"
        verify = st.get("dflash_verify_by_batch")
        kept = [f"{v} from batch {m}" for m, v in verify or []]
        if kept:
            kept[0] = kept[0].replace(" from", " tokens from", 1)
        out += f"; the verify keeps its first {', '.join(kept)}" if kept else ""
        dv = next((r["draft_vocab"] for r in report["rows"] if r.get("draft_vocab") and r["algo"] == "dflash"), None)
        out += f"; drafting from the {dv:,} most frequent tokens." if dv else "."
    if "ddtree_by_batch" in st and "ddtree" in algos:
        dd = st["ddtree"]
        decay = st.get("ddtree_depth_decay", 1.0)   # (reports from before the setting ran at 1)
        out += (f" DDTree: topk {dd['topk']}, {dd['num_draft_tokens']} tokens"
                f"{_from_batch(st.get('ddtree_by_batch'))}"
                + (f", position k's log-probabilities weighed {decay:g} ** (k - 1)." if decay != 1.0 else "."))
    if "ngram_topk_by_batch" in st and "ngram" in algos:
        ng = st["ngram"]
        out += (f" N-gram: {ng['topk']} chains of {ng['num_steps']} (suffixes of up to {ng['ngram_size']} tokens)"
                f"{_from_batch(st.get('ngram_topk_by_batch'))}.")
    return out


def _admission_settings(report: dict) -> str:
    """The admission batching of the run: rows free before waiting requests are prefilled."""
    per_bs = {r["bs"]: r["min_free_slots"] for r in report["rows"] if r.get("min_free_slots")}
    if all(n == 1 for n in per_bs.values()):
        return ""
    return (" Waiting requests are prefilled once "
            + ", ".join(f"{n} (bs {bs})" for bs, n in sorted(per_bs.items())) + " rows are free.")


def _length_settings(report: dict) -> str:
    st = report["settings"]
    if st.get("stop_at_eos"):
        return f"up to {st['max_new_tokens']} new tokens per request (a request ends at its end-of-turn token)"
    return f"{st['max_new_tokens']} new tokens per request"


def _first_timing(first: dict) -> str:
    """A re-timed row's first timing, for the markdown (runs before ``profiled_step_ms``
    recorded the kernel share of that timing as ``gpu_busy``)."""
    if first.get("gpu_busy") is not None:
        return f"first {first['tokens_per_s']:.1f} tokens/s at GPU busy {first['gpu_busy']:.2f}"
    return f"first {first['tokens_per_s']:.1f} tokens/s, {first['step_ms']:.3f} ms a round"


def markdown(report: dict) -> str:
    """The report as a markdown table (one row per measured pair)."""
    dev = report["device"]["name"]
    lines = [f"# End to end: {report['model']} on {dev}",
             "",
             f"{report['timestamp']}, commit `{(report.get('commit') or 'unknown')[:12]}`, "
             f"torch {report['versions']['torch']}, triton {report['versions']['triton']}; "
             f"{_length_settings(report)}, "
             f"{_prompt_counts(report)}, CUDA graphs, greedy.{_eagle_settings(report)}"
             f"{_dflash_ngram_settings(report)}{_admission_settings(report)}",
             "",
             "| prompts | algo | bs | dtype | backend | tokens/s | speedup | accept length | step ms | "
             "kernels/step | kernel ms/step | gpu_busy | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        prompts = r.get("prompt_set", "chat")
        if "error" in r:
            lines.append(f"| {prompts} | {r['algo']} | {r['bs']} | {r['dtype']} | {r['backend']} | error: "
                         f"{r['error'][:80]} | | | | | | | |")
            continue
        lines.append(f"| {prompts} | {r['algo']} | {r['bs']} | {r['dtype']} | {r['backend']} | "
                     f"{r['tokens_per_s']:.1f} | {_cell(r.get('speedup'), '.2f')} | "
                     f"{r['accept_length']:.2f} | {_cell(r.get('step_ms'), '.3f')} | "
                     f"{_cell(r.get('kernels_per_step'), '.0f')} | {_cell(r.get('kernel_ms_per_step'), '.3f')} | "
                     f"{_cell(r.get('gpu_busy'), '.2f')} | {r.get('lossless') or '-'} |")
    retimed = [r for r in report["rows"] if r.get("retimed")]
    if retimed:
        bound = (report.get("settings") or {}).get("retime_below_busy")
        lines += ["", f"Re-timed (kernels busy under {_cell(bound, '.2f')} of the first timing's rounds, a host "
                  "stall; the faster timing is kept): " + ", ".join(
                      f"{r.get('prompt_set', 'chat')} {r['algo']} bs {r['bs']} ({_first_timing(r['retimed'])})"
                      for r in retimed) + "."]
    missing = unmeasured_rows(report)
    if missing:
        lines += ["", "Not measured (the run stopped before these rows, e.g. at a time limit): "
                  + ", ".join(f"{s} {a} bs {b}" for s, a, b in missing) + "."]
    return "\n".join(lines) + "\n"


def unmeasured_rows(report: dict) -> List[Tuple[str, str, int]]:
    """``(prompt set, algo, bs)`` of every row the report's settings plan that it lacks, in
    the order a run measures them: batch sizes outermost, then the chat and repetitive sets
    (without ``cycle_prompts``, a set with fewer prompts than the batch size plans nothing
    there), each set's algos,
    then the HF peer at batch 1 and 16 on the chat set (with peers and the default model).
    Empty for a complete run; a report without settings plans nothing."""
    st, counts = report.get("settings") or {}, report.get("num_prompts") or {}
    if not isinstance(counts, dict):   # one prompt count: the chat set's
        counts = {"chat": counts}
    have = {(r.get("prompt_set", "chat"), r.get("algo"), r.get("bs")) for r in report.get("rows", [])}
    sets = [("chat", list(st.get("algos") or []))]
    if st.get("repetitive_algos"):
        sets.append(("repetitive", list(st["repetitive_algos"])))
    planned = []
    for bs in st.get("batch_sizes") or []:
        for name, algos in sets:
            if counts.get(name, 0) < (1 if st.get("cycle_prompts") else bs):
                continue
            planned += [(name, a, bs) for a in algos]
            if name == "chat" and st.get("peers") and st.get("model") is None and bs in (1, 16):
                planned.append((name, "hf_static", bs))
    return [p for p in planned if p not in have]


def png_bars(report: dict) -> Dict[int, List[Tuple[str, str, float, Optional[float]]]]:
    """The bars of :func:`render_png`: per batch size, ``(label, algo, tokens/s, accept
    length)`` in row order; a row of a prompt set other than ``chat`` is labelled
    ``"algo (set)"``, so the sets' rows of one algorithm stay apart."""
    out: Dict[int, List[Tuple[str, str, float, Optional[float]]]] = {}
    for r in report["rows"]:
        if "error" in r:
            continue
        ps = r.get("prompt_set", "chat")
        label = r["algo"] if ps == "chat" else f"{r['algo']} ({ps})"
        out.setdefault(r["bs"], []).append((label, r["algo"], r["tokens_per_s"], r.get("accept_length")))
    return dict(sorted(out.items()))


def render_png(report: dict, path: Path) -> bool:
    """Bar chart of tokens/s per algorithm (and prompt set) and batch size, accept length
    annotated (:func:`png_bars`).  Returns False (nothing written) when matplotlib is not
    installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bars_by_bs = png_bars(report)
    algos = list(dict.fromkeys(a for bars in bars_by_bs.values() for _, a, _, _ in bars))
    sizes = list(bars_by_bs)
    fig, axes = plt.subplots(1, len(sizes), figsize=(3.6 * len(sizes), 4.0), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, bs in zip(axes[0], sizes):
        here = bars_by_bs[bs]
        drawn = ax.bar(range(len(here)), [v for _, _, v, _ in here],
                       color=[colors(algos.index(a)) for _, a, _, _ in here], edgecolor="white")
        for b, (label, a, _, acc) in zip(drawn, here):
            if label != a:
                b.set_hatch("//")
            if acc and a not in ("none", "hf_static"):
                ax.annotate(f"{acc:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(here)), [label for label, _, _, _ in here], rotation=45, ha="right", fontsize=8)
        ax.set_title(f"bs {bs}", fontsize=9)
        ax.set_ylabel("tokens/s" if bs == sizes[0] else "")
    fig.suptitle(f"{report['model']}, {report['device']['name']} ({report['timestamp'][:10]}); "
                 f"labels: tokens per verify; hatched: the repetitive prompt set", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


#: report fields every part of one run must share (``settings`` apart from ``batch_sizes``)
_SHARED = ("suite", "commit", "model", "num_prompts", "drafters")


def merge_parts(parts: Sequence[dict]) -> dict:
    """One e2e report from the reports of a run made in parts (``specattn bench e2e`` with
    disjoint ``--bs`` lists, e.g. one job per part under a time limit): the earliest part's
    device, versions, timestamp and ceilings; ``settings.batch_sizes`` the parts' together,
    ascending; the rows ordered by batch size as one run would measure them (each part's
    speedups are over its own plain-decoding rows of the same batch, as in one run).

    Raises:
        ValueError: no parts, a part that is not an e2e report, parts of different commits,
            models, prompt counts, drafters, devices or settings (``batch_sizes`` aside), or a
            row (prompt set, algo, batch size) measured by two parts.
    """
    if not parts:
        raise ValueError("no e2e reports to merge")
    parts = sorted(parts, key=lambda r: r.get("timestamp") or "")
    head = parts[0]
    for part in parts:
        if part.get("suite") != SUITE:
            raise ValueError(f"not an e2e report (suite {part.get('suite')!r})")
        diff = [k for k in _SHARED if part.get(k) != head.get(k)]
        if (part.get("device") or {}).get("name") != (head.get("device") or {}).get("name"):
            diff.append("device")
        st = {k: v for k, v in (part.get("settings") or {}).items() if k != "batch_sizes"}
        if st != {k: v for k, v in (head.get("settings") or {}).items() if k != "batch_sizes"}:
            diff.append("settings")
        if diff:
            raise ValueError(f"the parts differ in {', '.join(diff)}: they are not one run")
    seen, rows = set(), []
    for part in parts:
        for r in part.get("rows", []):
            key = (r.get("prompt_set", "chat"), r.get("algo"), r.get("bs"))
            if key in seen:
                raise ValueError(f"row {key} is in two parts")
            seen.add(key)
            rows.append(r)
    sizes = sorted({b for p in parts for b in (p.get("settings") or {}).get("batch_sizes") or []} |
                   {r.get("bs") for r in rows})
    rows.sort(key=lambda r: sizes.index(r.get("bs")))   # stable: each part's order within a batch
    merged = dict(head, rows=rows)
    merged["settings"] = dict(head.get("settings") or {}, batch_sizes=sizes)
    return merged


def write_results(report: dict, out_dir: Path) -> List[Path]:
    """``out_dir/e2e.json`` + ``e2e.md`` (+ ``e2e.png`` where matplotlib is installed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{SUITE}.json", out_dir / f"{SUITE}.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    png = out_dir / f"{SUITE}.png"
    if render_png(report, png):
        paths.append(png)
    return paths
