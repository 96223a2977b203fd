"""``specattn drafter train``: train an EAGLE-3 (``--kind eagle3``, the default) or a DFlash
(``--kind dflash``) drafter for the target by self-distillation.

``drafter_app`` is a typer app with one command, ``train``; the top-level CLI mounts it as
``specattn drafter``.  The work is :func:`specattn.spec_runtime.train_drafter.run_training`.
Bad arguments exit with status 2 and one line on stderr; so does an ``--out`` folder that
already holds a drafter's files (:func:`out_files_present`), unless ``--overwrite``.

Several GPUs: start one process per GPU with ``torchrun`` (``torchrun --nproc-per-node 4 -m
specattn drafter train --device cuda ...``); the processes share the data generation and
train data-parallel (``train_drafter.init_distributed``), rank 0 prints and writes.
"""
from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import List, Optional

import torch
import typer

from .drafter_base import TOKEN_FREQUENCIES_FILE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("triton", "torch_reference", "flashinfer")

KINDS = ("eagle3", "dflash")
#: the longest --seq-len accepted before the target loads (its context bounds it after)
MAX_SEQ_LEN = 1 << 20
#: options that only shape the data generation (ignored, with a note, when --data is a cache)
GENERATION_OPTIONS = ("prompts", "gen_batch", "max_new_tokens", "greedy", "samples_per_prompt", "temperature",
                      "top_p", "top_k", "seed_max_new_tokens", "seed_temperature", "self_prompts",
                      "self_prompt_max_tokens", "self_prompt_openers", "num_seeds", "data_time_budget_s")
#: options of one drafter kind only, with their defaults (None on the command line = not given)
EAGLE3_ONLY = {"ttt_steps": 7}
DFLASH_ONLY = {"block_size": 16, "draft_layers": 2, "num_context_layers": 3, "draft_intermediate_size": 0,
               "num_anchors": 128, "loss_decay_gamma": 7.0, "mask_token_id": None, "max_checkpoint_mib": 12.0}

#: the files a run writes into --out (``train_drafter.export``); a folder holding one is refused
#: without --overwrite
OUT_FILES = ("config.json", "model.safetensors", "README.md", "train_log.json", TOKEN_FREQUENCIES_FILE)

drafter_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="EAGLE-3 and DFlash drafters for the target model.")


@drafter_app.callback()
def _drafter():
    """EAGLE-3 and DFlash drafters for the target model (checkpoints SGLang loads; EAGLE-3 also vLLM)."""


def _fail(msg: str) -> None:
    typer.echo(f"specattn drafter train: error: {msg}", err=True)
    raise typer.Exit(code=2)


def _note_idle(ctx: typer.Context, names, why: str) -> None:
    """A note on stderr naming the options among ``names`` given on the command line (or by
    environment) that do nothing, ``why``."""
    from .cli import option_given
    given = [f"--{n.replace('_', '-')}" for n in names if option_given(ctx, n)]
    if given:
        typer.echo(f"specattn drafter train: note: {why} {', '.join(given)} "
                   f"{'does' if len(given) == 1 else 'do'} nothing", err=True)


def out_files_present(out: Path) -> List[str]:
    """The names of :data:`OUT_FILES` that folder ``out`` already holds (empty for a missing or
    empty folder): a pure file-system check, made before any work, so every process of a
    torchrun launch sees the folder as it was before rank 0 writes anything."""
    return [name for name in OUT_FILES if (out / name).exists() or (out / name).is_symlink()]


def _command_line(ctx: typer.Context) -> str:
    """The full command with every option spelled out (what the model card records)."""
    parts = ["specattn", "drafter", "train"]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if v is None or not p.opts:
            continue
        if isinstance(v, bool):
            if p.secondary_opts:
                parts.append(p.opts[0] if v else p.secondary_opts[0])
            elif v:
                parts.append(p.opts[0])
            continue
        parts += [p.opts[0], shlex.quote(str(v))]
    return " ".join(parts)


@drafter_app.command("train")
def train_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Output folder: config.json, model.safetensors, README.md, "
                                                "train_log.json (refused if it holds them already, unless "
                                                "--overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the drafter files an existing --out folder "
                                                              "holds (--init-from may name that folder: its weights "
                                                              "are read before anything is written)."),
    kind: str = typer.Option("eagle3", help="Drafter: eagle3 (one layer over three target layers, chain "
                                            "drafting) | dflash (a block drafter, z-lab's checkpoint layout)."),
    model: Optional[str] = typer.Option(None, help="Target: a GGUF file or HF dir (default: SmolLM2-135M-Instruct)."),
    prompts: Optional[Path] = typer.Option(None, help="Training prompts, one per line (default: the packaged "
                                                      "spec_runtime/data/train_prompts.txt)."),
    data: Optional[Path] = typer.Option(None, help="Data cache (.safetensors): loaded if it exists (generation "
                                                   "skipped), else generated and written here."),
    device: str = typer.Option("cuda" if torch.cuda.is_available() else "cpu",
                               help="cuda | cpu (under torchrun, cuda: each process takes GPU LOCAL_RANK)."),
    dtype: Optional[str] = typer.Option(None, help="Target dtype: float32 | bfloat16 | float16 (default: "
                                                   "bfloat16 on cuda, float32 on cpu)."),
    backend: Optional[str] = typer.Option(None, help="Attention backend for data generation (default: triton "
                                                     "on cuda, torch_reference on cpu)."),
    cuda_graph: Optional[bool] = typer.Option(None, "--cuda-graph/--eager", help="CUDA graphs for data "
                                                                                 "generation (default: on on cuda)."),
    gen_batch: int = typer.Option(64, help="Prompts per generation batch."),
    max_new_tokens: int = typer.Option(384, help="Response length limit (also capped by --seq-len)."),
    greedy: bool = typer.Option(True, "--greedy/--no-greedy", help="One greedy response per prompt."),
    samples_per_prompt: int = typer.Option(6, help="Sampled responses per prompt."),
    temperature: float = typer.Option(0.8, help="Sampling temperature of the sampled responses."),
    top_p: float = typer.Option(0.95, help="Top-p of the sampled responses."),
    top_k: int = typer.Option(0, help="Top-k of the sampled responses (0 = off)."),
    num_seeds: int = typer.Option(2000, help="Raw-text seeds (first words of prompts, common openers) continued "
                                            "by sampling."),
    self_prompts: int = typer.Option(0, help="User queries the target writes itself (sampled continuations of "
                                             "its chat template's pre-query text, Magpie-style), added to "
                                             "--prompts; those that end within --self-prompt-max-tokens count."),
    self_prompt_max_tokens: int = typer.Option(96, help="Length limit of a self-written query."),
    self_prompt_openers: float = typer.Option(0.0, help="Fraction (0..1) of the self-written queries that start "
                                                        "from the first 1-4 words of a random --prompts prompt; "
                                                        "the target writes the rest, so the queries follow the "
                                                        "file's kinds of request."),
    seed_max_new_tokens: int = typer.Option(256, help="Length limit of the seed continuations."),
    seed_temperature: float = typer.Option(0.9, help="Temperature of the seed continuations."),
    data_time_budget_s: float = typer.Option(120.0, help="Start no generation batch after this many seconds "
                                                         "(0 = no limit)."),
    seq_len: int = typer.Option(512, help="Tokens per packed training row."),
    batch_size: int = typer.Option(16, help="Rows per training step."),
    steps: int = typer.Option(3000, help="Optimizer steps (the schedule shrinks to fit --time-budget-s)."),
    ttt_steps: Optional[int] = typer.Option(None, help="eagle3: training-time-test steps unrolled per step "
                                                       "(default 7)."),
    block_size: Optional[int] = typer.Option(None, help="dflash: block = root + block_size - 1 drafts (default 16)."),
    draft_layers: Optional[int] = typer.Option(None, help="dflash: drafter layers (default 2; z-lab's published "
                                                          "drafters have 5, 36.9 MiB at this model's width)."),
    num_context_layers: Optional[int] = typer.Option(None, help="dflash: target layers whose hidden states feed "
                                                                "the drafter (default 3)."),
    draft_intermediate_size: Optional[int] = typer.Option(None, help="dflash: MLP width of the drafter (default 0 "
                                                                     "= the widest multiple of 128 up to the "
                                                                     "target's that fits --max-checkpoint-mib)."),
    num_anchors: Optional[int] = typer.Option(None, help="dflash: blocks (random anchors) per packed row "
                                                         "(default 128)."),
    loss_decay_gamma: Optional[float] = typer.Option(None, help="dflash: loss weight exp(-(k-1)/gamma) of block "
                                                                "position k (default 7; 0 = uniform)."),
    mask_token_id: Optional[int] = typer.Option(None, help="dflash: mask token id in the target's vocabulary "
                                                           "(default 16, SmolLM2's <empty_output>)."),
    max_checkpoint_mib: Optional[float] = typer.Option(None, help="dflash: size budget of the bf16 checkpoint "
                                                                  "(default 12; 0 = none)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW)."),
    min_lr_ratio: float = typer.Option(0.1, help="Final learning rate / peak (cosine)."),
    warmup_steps: int = typer.Option(100, help="Linear warm-up steps."),
    weight_decay: float = typer.Option(0.01, help="AdamW weight decay (matrices only)."),
    grad_clip: float = typer.Option(1.0, help="Gradient norm clip (0 = off)."),
    seed: int = typer.Option(0, help="Seed of init, split, data order and sampling."),
    eval_frac: float = typer.Option(0.05, help="Fraction of prompts / seeds held out."),
    eval_every: int = typer.Option(250, help="Evaluate on held-out batches every N steps (0 = only at the end)."),
    eval_batches: int = typer.Option(8, help="Held-out batches per periodic evaluation (the final one uses all)."),
    loss_chunk: int = typer.Option(2048, help="Rows per LM-head chunk in the loss (bounds memory)."),
    time_budget_s: float = typer.Option(385.0, help="Stop training after this many seconds (0 = no limit)."),
    amp: bool = typer.Option(True, "--amp/--no-amp", help="bf16 autocast on cuda."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Start from this drafter folder's "
                                             "weights (the same kind and shapes, e.g. an earlier run's --out) "
                                             "instead of a random init: a longer training in several runs."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars."),
):
    """Generate data with the target, train a drafter on it (EAGLE-3: training-time test; DFlash:
    blocks at random anchors; both distilled with a soft cross-entropy to the target's
    distributions) and export it with a model card.  Under torchrun (one process per GPU,
    --device cuda) the processes share the data generation and train data-parallel,
    --batch-size rows each per step."""
    from rich.console import Console

    from .train_drafter import (DEFAULT_TRAIN_PROMPTS, GenConfig, RunOptions, TrainConfig, init_distributed,
                                read_prompts, run_training)
    if kind not in KINDS:
        _fail(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    mine, other = (EAGLE3_ONLY, DFLASH_ONLY) if kind == "eagle3" else (DFLASH_ONLY, EAGLE3_ONLY)
    for name in other:
        if ctx.params.get(name) is not None:
            _fail(f"--{name.replace('_', '-')} is not an option of --kind {kind}")
    for name, default in mine.items():   # resolved, so the recorded command spells every option out
        if ctx.params.get(name) is None:
            ctx.params[name] = default
    opt = {name: ctx.params[name] for name in mine}
    dev = device.strip().lower()
    if not (dev == "cpu" or dev == "cuda" or dev.startswith("cuda:")):
        _fail(f"--device must be cuda or cpu, got {device!r}")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        _fail("--device cuda but no CUDA device is available (use --device cpu)")
    if dtype is None:
        dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        _fail(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dev == "cpu" and dtype != "float32":   # the drafter trains in float32 under autocast, CUDA only
        _fail(f"--dtype {dtype} needs --device cuda (bf16 autocast); on the CPU use --dtype float32")
    if backend is None:
        backend = "triton" if dev.startswith("cuda") else "torch_reference"
    if backend not in BACKENDS:
        _fail(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    from .cli import runs_on_cpu
    if dev == "cpu" and not runs_on_cpu(backend):
        _fail(f"--backend {backend} needs --device cuda; on the CPU use --backend torch_reference")
    if cuda_graph and not dev.startswith("cuda"):
        _fail("--cuda-graph needs --device cuda")
    for name, v in (("gen-batch", gen_batch), ("max-new-tokens", max_new_tokens), ("seq-len", seq_len),
                    ("batch-size", batch_size), ("steps", steps), ("ttt-steps", opt.get("ttt_steps", 1)),
                    ("seed-max-new-tokens", seed_max_new_tokens), ("loss-chunk", loss_chunk),
                    ("self-prompt-max-tokens", self_prompt_max_tokens),
                    ("eval-batches", eval_batches), ("draft-layers", opt.get("draft_layers", 1)),
                    ("num-context-layers", opt.get("num_context_layers", 1)),
                    ("num-anchors", opt.get("num_anchors", 1))):
        if v < 1:
            _fail(f"--{name} must be >= 1, got {v}")
    if kind == "dflash":
        for name in ("draft_intermediate_size", "loss_decay_gamma", "max_checkpoint_mib", "mask_token_id"):
            if opt[name] is not None and opt[name] < 0:
                _fail(f"--{name.replace('_', '-')} must be >= 0, got {opt[name]}")
        if not 2 <= opt["block_size"] <= seq_len:
            _fail(f"--block-size must be in [2, --seq-len {seq_len}], got {opt['block_size']}")
    for name, v in (("samples-per-prompt", samples_per_prompt), ("num-seeds", num_seeds),
                    ("self-prompts", self_prompts),
                    ("warmup-steps", warmup_steps), ("eval-every", eval_every), ("top-k", top_k),
                    ("time-budget-s", time_budget_s), ("data-time-budget-s", data_time_budget_s),
                    ("weight-decay", weight_decay), ("grad-clip", grad_clip)):
        if v < 0:
            _fail(f"--{name} must be >= 0, got {v}")
    for name, v in (("lr", lr), ("weight-decay", weight_decay), ("grad-clip", grad_clip),
                    ("time-budget-s", time_budget_s), ("data-time-budget-s", data_time_budget_s),
                    ("temperature", temperature), ("seed-temperature", seed_temperature),
                    *((n.replace("_", "-"), opt[n]) for n in ("loss_decay_gamma", "max_checkpoint_mib")
                      if kind == "dflash" and opt[n] is not None)):
        if not math.isfinite(v):   # NaN passes every comparison; a budget of 0 means no limit
            _fail(f"--{name} must be a finite number, got {v}")
    if not 3 <= seq_len <= MAX_SEQ_LEN:
        _fail(f"--seq-len must be in [3, {MAX_SEQ_LEN}] (and within the target's context), got {seq_len}")
    if not 0 <= seed < 2 ** 40:
        _fail(f"--seed must be in [0, 2**40), got {seed}")
    if not lr > 0:
        _fail(f"--lr must be > 0, got {lr}")
    if not 0 <= min_lr_ratio <= 1:
        _fail(f"--min-lr-ratio must be in [0, 1], got {min_lr_ratio}")
    if not 0 <= eval_frac < 1:
        _fail(f"--eval-frac must be in [0, 1), got {eval_frac}")
    if not (temperature > 0 and seed_temperature > 0):
        _fail("--temperature and --seed-temperature must be > 0")
    if not 0 < top_p <= 1:
        _fail(f"--top-p must be in (0, 1], got {top_p}")
    if not 0 <= self_prompt_openers <= 1:
        _fail(f"--self-prompt-openers must be in [0, 1], got {self_prompt_openers}")
    if not greedy and samples_per_prompt == 0:
        _fail("--no-greedy needs --samples-per-prompt >= 1")
    prompts = prompts or DEFAULT_TRAIN_PROMPTS
    have_data = data is not None and data.is_file()
    if not have_data:
        try:   # read now: a bad file fails before the model loads
            read_prompts(prompts)
        except (FileNotFoundError, ValueError, OSError) as e:
            _fail(f"--prompts: {e}")
    else:
        _note_idle(ctx, GENERATION_OPTIONS, f"--data {data} exists, so no data is generated and")
    if not have_data and self_prompts == 0:
        _note_idle(ctx, ("self_prompt_openers", "self_prompt_max_tokens"), "with --self-prompts 0,")
    if not have_data and samples_per_prompt == 0:
        _note_idle(ctx, ("temperature", "top_p", "top_k"), "with --samples-per-prompt 0 (greedy responses only),")
    if eval_frac == 0:
        _note_idle(ctx, ("eval_every", "eval_batches"), "with --eval-frac 0 (nothing held out),")
    if model is not None and not Path(model).exists():
        _fail(f"--model {model}: no such file or folder")
    from .cli import out_dir_problem
    why = out_dir_problem(out)
    if why:
        _fail(f"--out: {why}")
    clash = [] if overwrite else out_files_present(out)
    if clash:
        _fail(f"--out {out} already holds a drafter's files ({', '.join(clash)}) that this run would overwrite: "
              f"pass --overwrite to replace them, or choose another --out folder")
    if data is not None and data.exists() and not data.is_file():
        _fail(f"--data {data} exists and is not a file")
    if data is not None and not data.exists():
        why = out_dir_problem(data.absolute().parent)
        if why:
            _fail(f"--data: {why}")
    if init_from is not None and not (init_from / "config.json").is_file():
        _fail(f"--init-from {init_from}: no drafter folder there (config.json missing)")
    if init_from is not None:
        from .cli import is_dflash_dir, is_eagle3_dir
        if not (is_dflash_dir if kind == "dflash" else is_eagle3_dir)(init_from):
            _fail(f"--init-from {init_from} does not hold a drafter of --kind {kind} (its config.json names another "
                  f"architecture)")

    gen = GenConfig(gen_batch=gen_batch, max_new_tokens=max_new_tokens, greedy=greedy,
                    samples_per_prompt=samples_per_prompt, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed_max_new_tokens=seed_max_new_tokens, seed_temperature=seed_temperature,
                    self_prompts=self_prompts, self_prompt_max_tokens=self_prompt_max_tokens,
                    self_prompt_openers=self_prompt_openers, backend=backend,
                    cuda_graph=cuda_graph, time_budget_s=data_time_budget_s, seed=seed)
    tc = TrainConfig(kind=kind, seq_len=seq_len, batch_size=batch_size, steps=steps, lr=lr,
                     min_lr_ratio=min_lr_ratio, warmup_steps=warmup_steps, weight_decay=weight_decay,
                     grad_clip=grad_clip, seed=seed, eval_frac=eval_frac, eval_every=eval_every,
                     eval_batches=eval_batches, loss_chunk=loss_chunk, time_budget_s=time_budget_s, amp=amp,
                     init_from=None if init_from is None else str(init_from), **opt)
    try:   # the bounds between options (TTT steps and anchors within a row, ...) before any work
        tc.validate()
        gen.validate()
    except ValueError as e:
        _fail(str(e))
    try:
        dist_ctx, dev = init_distributed(dev)
    except ValueError as e:
        _fail(str(e))
    command = _command_line(ctx)
    if dist_ctx.enabled:   # the card records the launch
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist_ctx.world_size))
        nodes = f"--nnodes {dist_ctx.world_size // per_node} " if per_node != dist_ctx.world_size else ""
        command = f"torchrun {nodes}--nproc-per-node {per_node} -m " + command
    opts = RunOptions(out=out, model=model, prompts=prompts, data=data, num_seeds=num_seeds, device=dev,
                      dtype=DTYPES[dtype], gen=gen, train=tc, command=command, progress=progress,
                      dist=dist_ctx)
    console = Console(stderr=True)
    from .cli import cpu_threads
    try:
        with cpu_threads(None, dev):   # a sane CPU thread count on a shared machine
            run_training(opts, console=console)
    except (ValueError, FileNotFoundError, ImportError, KeyError) as e:
        _fail(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))
    finally:
        if dist_ctx.enabled:
            import torch.distributed as tdist
            tdist.destroy_process_group()
