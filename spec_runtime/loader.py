"""Load Llama weights, config and tokenizer (GGUF or HF safetensors dir), and the HF oracle.

Weights are returned as ``dict[str, torch.Tensor]`` under the names of HF
``LlamaForCausalLM`` (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
...), CPU tensors in HF's ``[out_features, in_features]`` orientation.  ``lm_head.weight``
is present only when the embeddings are not tied.

GGUF: read with ``gguf.GGUFReader``, dequantized with ``gguf.quants.dequantize`` (to
float32, then cast to ``dtype``).  llama.cpp's converter permutes the rows of the Q and K
projections per head for its rope layout; :func:`load_gguf` undoes it exactly like
transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does, so the result
equals ``LlamaForCausalLM.from_pretrained(dir, gguf_file=...)``'s state dict bit for bit.
"""
from __future__ import annotations

import contextlib
import json
import numbers
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = [
    "LlamaConfig", "check_decoder_shape", "check_weight_shapes", "is_gguf_file", "load_gguf", "load_hf_dir",
    "load_tokenizer", "apply_chat_template", "chat_user_prefix_ids", "stop_token_ids",
    "load_hf_oracle", "hf_greedy", "write_random_hf_dir",
]


def check_decoder_shape(config, int_fields) -> None:
    """Shared checks of a decoder config dataclass (``LlamaConfig`` and the drafters'):
    every name in ``int_fields`` a positive int, query heads a multiple of KV heads, an even
    ``head_dim`` (RoPE rotates halves), ``rms_norm_eps`` and ``rope_theta`` > 0.

    Raises:
        ValueError: naming the config class and the field.
    """
    name = type(config).__name__
    for k in int_fields:
        v = getattr(config, k)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}.{k} must be a positive int, got {v!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={config.num_key_value_heads}")
    if config.head_dim % 2:
        raise ValueError(f"head_dim={config.head_dim} must be even for RoPE")
    if not (config.rms_norm_eps > 0 and config.rope_theta > 0):
        raise ValueError(f"rms_norm_eps={config.rms_norm_eps} and rope_theta={config.rope_theta} must be > 0")


def _token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """``ids`` (None, one int or a sequence of ints) as a list of token ids in
    ``[0, vocab_size)``: TypeError for floats, bools and strings (never truncated), ValueError
    outside the vocabulary."""
    if ids is None:
        return []
    items = [ids] if isinstance(ids, numbers.Integral) and not isinstance(ids, bool) else ids
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{name} must be an int or a list of ints, got {ids!r}")
    out = []
    for t in items:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name} must be an int or a list of ints, got {ids!r}")
        if not 0 <= int(t) < vocab_size:
            raise ValueError(f"{name} must lie in the vocabulary [0, {vocab_size}), got {ids!r}")
        out.append(int(t))
    return out


@dataclass
class LlamaConfig:
    """Shape and numeric hyper-parameters of a Llama decoder (defaults mirror HF's
    ``LlamaConfig``).  ``rope_theta`` is the RoPE base; ``head_dim`` is per head;
    ``eos_token_ids`` lists every end token (may be empty)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])

    def __post_init__(self):
        check_decoder_shape(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "max_position_embeddings"))
        self.eos_token_ids = _token_ids("eos_token_ids", self.eos_token_ids, self.vocab_size)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "LlamaConfig":
        """From a HF ``config.json`` dict (transformers 4 ``rope_theta`` or 5 ``rope_parameters``).

        Raises:
            ValueError: not a plain Llama (other ``model_type``, non-silu activation,
                attention/MLP biases, rope scaling) or missing/invalid sizes.
        """
        if d.get("model_type", "llama") != "llama":
            raise ValueError(f"model_type={d.get('model_type')!r}: only 'llama' is supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r}: only 'silu' is supported")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        try:
            heads = d["num_attention_heads"]
            return cls(
                vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id", 1), eos_token_ids=d.get("eos_token_id", 2),
            )
        except KeyError as e:
            raise ValueError(f"HF config is missing {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict:
        """A ``config.json`` dict that ``transformers.LlamaForCausalLM`` loads (4.x and 5.x keys)."""
        d = asdict(self)
        eos = d.pop("eos_token_ids")
        d.update(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
            attention_bias=False, mlp_bias=False,
            eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        return d

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected ``name -> shape`` of every weight (HF names, ``[out, in]``)."""
        h, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
        s = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            s.update({
                p + "self_attn.q_proj.weight": (self.num_attention_heads * dh, h),
                p + "self_attn.k_proj.weight": (self.num_key_value_heads * dh, h),
                p + "self_attn.v_proj.weight": (self.num_key_value_heads * dh, h),
                p + "self_attn.o_proj.weight": (h, self.num_attention_heads * dh),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            })
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (self.vocab_size, h)
        return s


def check_weight_shapes(want: dict, weights: dict, source) -> None:
    """The one check of a checkpoint's tensors (the target's and the drafters'): ``weights``
    (``name -> tensor``) must hold exactly the names of ``want`` (``name -> shape``), each
    with that shape.

    Raises:
        ValueError: naming ``source``, the missing / unexpected names (the first six of each)
            or the first misshapen tensor.
    """
    def head(names):
        return f"{names[:6]}{' ...' if len(names) > 6 else ''}"

    missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or extra:
        raise ValueError(f"{source}: missing tensors {head(missing)}, unexpected tensors {head(extra)}")
    for k, shape in want.items():
        if tuple(weights[k].shape) != tuple(shape):
            raise ValueError(f"{source}: {k} has shape {tuple(weights[k].shape)}, expected {tuple(shape)}")


def _check_weights(config: LlamaConfig, weights: dict, source) -> None:
    check_weight_shapes(config.param_shapes(), weights, source)


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")


# ----------------------------------------------------------------------------- GGUF

def _unpermute_rope_rows(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation.  ``w``: ``[n_head * head_dim, in]``.

    llama.cpp (``convert_hf_to_gguf.py`` ``LlamaModel.permute``) writes, per head,
    ``w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)`` (HF's half-split rotary
    layout -> interleaved pairs).  The inverse, as in transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``: ``reshape(n_head, head_dim // 2, 2, in)
    .swapaxes(1, 2)``.  For K, ``n_head`` is the number of KV heads."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _gguf_config(reader, source) -> LlamaConfig:
    def get(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{source}: general.architecture={arch!r}, only 'llama' is supported")
    scaling = get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{source}: rope scaling {scaling!r} is not supported")
    try:
        hidden, heads = int(get("llama.embedding_length")), int(get("llama.attention.head_count"))
        vocab = get("llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
        eos = [int(t) for t in (get("tokenizer.ggml.eos_token_id"), get("tokenizer.ggml.eot_token_id"))
               if t is not None]
        return LlamaConfig(
            vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(get("llama.feed_forward_length")),
            num_hidden_layers=int(get("llama.block_count")), num_attention_heads=heads,
            num_key_value_heads=int(get("llama.attention.head_count_kv", heads)),
            head_dim=int(get("llama.rope.dimension_count") or hidden // heads),
            rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("llama.rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("llama.context_length", 2048)),
            tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos)),
        )
    except (TypeError, KeyError) as e:
        raise ValueError(f"{source}: GGUF metadata is missing a required llama key ({e})") from None


def _gguf_to_hf_names(n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF name, built from gguf-py's own name table."""
    from gguf import TENSOR_NAMES, MODEL_TENSOR as T

    glob = {T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head"}
    per_layer = {
        T.ATTN_Q: "self_attn.q_proj", T.ATTN_K: "self_attn.k_proj", T.ATTN_V: "self_attn.v_proj",
        T.ATTN_OUT: "self_attn.o_proj", T.FFN_GATE: "mlp.gate_proj", T.FFN_UP: "mlp.up_proj",
        T.FFN_DOWN: "mlp.down_proj", T.ATTN_NORM: "input_layernorm",
        T.FFN_NORM: "post_attention_layernorm",
    }
    m = {TENSOR_NAMES[k] + ".weight": v + ".weight" for k, v in glob.items()}
    for i in range(n_layers):
        for k, v in per_layer.items():
            m[TENSOR_NAMES[k].format(bid=i) + ".weight"] = f"model.layers.{i}.{v}.weight"
    return m


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, *, progress=None
              ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read a llama GGUF (any quantization gguf-py can dequantize) into HF-named weights.

    Args:
        path: the ``.gguf`` file.
        dtype: floating dtype of the returned tensors (dequantized in float32 first).
        progress: optional ``progress(done, total)``, called after each tensor is
            dequantized (the 135M model: 272 tensors, a few seconds on 2 CPU cores).

    Returns:
        ``(config, weights)``; weights are contiguous CPU tensors, ``[out, in]`` for
        linears, ``[vocab, hidden]`` for embeddings, ``[hidden]`` for norms.

    Raises:
        FileNotFoundError: no such file.  ValueError: not a GGUF, not llama, unsupported
        rope scaling, or tensors missing / unexpected / of the wrong shape.
    """
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    _check_dtype(dtype)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise ValueError(f"{path}: cannot read as GGUF ({e})") from e
    config = _gguf_config(reader, path)
    names = _gguf_to_hf_names(config.num_hidden_layers)
    weights = {}
    for i, t in enumerate(reader.tensors):
        hf = names.get(t.name, t.name)  # unknown names are reported by _check_weights
        # np.asarray: a plain view of the memory map (2-3x faster to dequantize than np.memmap)
        w = dequantize(np.asarray(t.data), t.tensor_type)  # float32, [out, in] / [n]
        if hf.endswith("self_attn.q_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_attention_heads)
        elif hf.endswith("self_attn.k_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_key_value_heads)
        weights[hf] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)  # own copy, not the map
        if progress is not None:
            progress(i + 1, len(reader.tensors))
    _check_weights(config, weights, path)
    return config, weights


# ----------------------------------------------------------------------------- HF dir

def load_hf_dir(path: str | os.PathLike, dtype: torch.dtype = torch.float32
                ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read a HF Llama checkpoint dir: ``config.json`` + ``*.safetensors`` (sharded or not).

    The config's ``eos_token_ids`` join ``config.json``'s ``eos_token_id`` and that of
    ``generation_config.json`` when there is one (what HF ``generate`` stops on).  A ``lm_head.weight`` saved alongside tied embeddings is dropped; rotary
    ``inv_freq`` buffers are ignored.  Returns ``(config, weights)`` as :func:`load_gguf`.

    Raises:
        FileNotFoundError: no dir / ``config.json`` / safetensors file.  ValueError: bad
        config, an unreadable safetensors file, or tensors missing / unexpected / of the
        wrong shape.
    """
    from safetensors.torch import load_file

    _check_dtype(dtype)
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found (expected a HF checkpoint dir)")
    config = LlamaConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():   # e.g. Llama-3-Instruct: the end-of-turn token is named only here
        try:
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{gen_file}: not a JSON object ({e})") from None
        try:
            extra = _token_ids("eos_token_id", gen_eos, config.vocab_size)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{gen_file}: {e}") from None
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    weights = {}
    for f in files:
        try:
            weights.update(load_file(f, device="cpu"))
        except FileNotFoundError:
            raise
        except Exception as e:   # safetensors' SafetensorError (truncated or not a safetensors file)
            raise ValueError(f"{f}: cannot read it ({e})") from e
    weights = {k: v.to(dtype).contiguous() for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _check_weights(config, weights, path)
    return config, weights


def random_weights(param_shapes: dict, seed: int = 0, dtype: torch.dtype = torch.float32
                   ) -> dict[str, torch.Tensor]:
    """Deterministic random CPU tensors for ``{name: shape}`` (HF names) from ``seed``:
    embeddings and ``lm_head`` ~ N(0, 1), other matrices ~ N(0, 4 / in_features), vectors
    (norm weights) ~ 1 + 0.1 N(0, 1); see :func:`write_random_hf_dir` for why."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {seed!r}")
    _check_dtype(dtype)
    g = torch.Generator().manual_seed(int(seed))
    out = {}
    for name, shape in param_shapes.items():
        w = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 1:
            w = 1.0 + 0.1 * w
        elif name not in ("model.embed_tokens.weight", "lm_head.weight"):
            w = w * (2.0 / shape[1] ** 0.5)
        out[name] = w.to(dtype).contiguous()
    return out


def write_random_hf_dir(path: str | os.PathLike, config: LlamaConfig, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> Path:
    """Write a random Llama checkpoint (``config.json`` + ``model.safetensors``) to ``path``.

    Deterministic in ``seed``.  Init: embeddings and ``lm_head`` ~ N(0, 1), other linears
    ~ N(0, 4 / in_features), norm weights ~ 1 + 0.1 N(0, 1).  Unlike HF's std-0.02 init,
    this gives peaked logits (std ~ sqrt(hidden)) and varied greedy continuations, tied or
    not (with std 1/sqrt(in) a tied model just repeats its last input token).  Loadable by :func:`load_hf_dir` and by
    ``transformers.LlamaForCausalLM.from_pretrained(path)``.  Returns ``Path(path)``.
    """
    from safetensors.torch import save_file

    _check_dtype(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config.param_shapes(), seed, dtype)
    d = config.to_hf_dict()
    d["dtype"] = d["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# ----------------------------------------------------------------------------- tokenizer

@contextlib.contextmanager
def _pretrained_source(path):
    """``(dir, from_pretrained kwargs)`` for a HF dir, or for a ``.gguf`` file a temporary
    folder holding only a link to it: ``from_pretrained(dir, gguf_file=...)`` prefers a
    ``tokenizer.json``, ``tokenizer_config.json`` or ``config.json`` beside the file to what
    the GGUF embeds, so a GGUF next to another model's files would load their vocabulary or
    template.  Raises FileNotFoundError for anything else."""
    p = Path(path)
    if is_gguf_file(p):
        with tempfile.TemporaryDirectory(prefix="specattn-gguf-") as tmp:
            (Path(tmp) / "model.gguf").symlink_to(p.resolve())
            yield Path(tmp), {"gguf_file": "model.gguf"}
        return
    if p.is_dir():
        yield p, {}
        return
    raise FileNotFoundError(f"{p} is neither a GGUF file nor a HF checkpoint dir")


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic ``b"GGUF"`` (whatever its
    name: ``.gguf``, ``.GGUF``, ``.bin``)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with p.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def stop_token_ids(config: LlamaConfig, tokenizer=None) -> list[int]:
    """The tokens that end a generation: ``config.eos_token_ids`` (a GGUF's EOS and EOT, a HF
    folder's ``config.json`` and ``generation_config.json`` EOS) plus the ``eos_token_id`` of
    ``tokenizer`` when given and set, in that order without repeats.  vLLM stops on the same
    union by default (the tokenizer's EOS and the generation config's ``eos_token_id``).  Give
    a HF folder's tokenizer, not one built from a GGUF: the GGUF's metadata is already in
    ``config`` and transformers' conversion can name another EOS (5.17 gave SmolLM2's
    ``<|im_start|>``)."""
    ids = list(config.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tok_eos is not None:
        ids.append(int(tok_eos))
    return list(dict.fromkeys(ids))


def load_tokenizer(path_or_gguf: str | os.PathLike):
    """A ``transformers`` tokenizer from a ``.gguf`` file (its embedded vocab, merges and
    chat template, whatever tokenizer files sit beside it) or a HF dir.  Raises
    FileNotFoundError for anything else."""
    from transformers import AutoTokenizer

    with _pretrained_source(path_or_gguf) as (d, kw):
        return AutoTokenizer.from_pretrained(d, **kw)


def apply_chat_template(tokenizer, prompt: str) -> list[int]:
    """Token ids of a single user message ``prompt`` rendered with the tokenizer's chat
    template plus the assistant generation prompt (for SmolLM2 this includes the default
    system message).  Raises ValueError if the tokenizer has no chat template."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template")
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(out, "keys"):  # some versions return a BatchEncoding regardless
        out = out["input_ids"]
    return [int(t) for t in out]


def chat_user_prefix_ids(tokenizer) -> list[int]:
    """Token ids of the tokenizer's chat template up to where a user message's text begins
    (for SmolLM2: the default system message, then ``<|im_start|>user\n``): the "pre-query
    template" from which an aligned model, asked to continue, writes a user query itself
    (Magpie: Xu et al., "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned
    LLMs with Nothing", arXiv 2406.08464).

    Raises:
        ValueError: no chat template, or one whose rendering of a user message does not
            start with the tokens of its text before that message.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template")
    sentinel = "\u2063specattn-user-text\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    cut = text.find(sentinel)
    if cut < 0:
        raise ValueError("the chat template does not render the user's text verbatim")
    ids = [int(t) for t in tokenizer.encode(text[:cut], add_special_tokens=False)]
    full = apply_chat_template(tokenizer, "Hello")
    if not ids or full[:len(ids)] != ids:
        raise ValueError("the chat template's text before the user message does not tokenize to a prefix "
                         "of a rendered conversation")
    return ids


# ----------------------------------------------------------------------------- HF oracle

def load_hf_oracle(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu"):
    """``transformers.LlamaForCausalLM`` from a ``.gguf`` file (dequantized by transformers)
    or a HF dir, in eval mode on ``device``: the reference for greedy outputs.
    Loading the 135M GGUF takes ~20 s on 2 CPU cores."""
    import transformers
    from transformers import LlamaForCausalLM

    _check_dtype(dtype)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    with _pretrained_source(path) as (d, kw):
        kw["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = dtype
        return LlamaForCausalLM.from_pretrained(d, **kw).to(device).eval()


@torch.inference_mode()
def hf_greedy(model, input_ids: list[int], max_new_tokens: int,
              eos_token_ids: list[int] | None = None) -> list[int]:
    """Greedy continuation of ``input_ids`` with a HF causal LM: a plain argmax loop over
    the model's own KV cache (no ``generate``: no logits processors, no implicit stopping).

    Args:
        model: e.g. from :func:`load_hf_oracle`.
        input_ids: prompt token ids (non-empty, each in ``[0, vocab)``).
        max_new_tokens: tokens to generate (>= 0).
        eos_token_ids: if given, stop right after emitting one of these (it is included in
            the output).  Default ``None``: never stop early; exactly ``max_new_tokens``.

    Returns:
        The new token ids only (not the prompt).  Ties go to the lowest id (``torch.argmax``).
    """
    vocab = model.config.vocab_size
    if not input_ids or any(not 0 <= int(t) < vocab for t in input_ids):
        raise ValueError(f"input_ids must be a non-empty list of ids in [0, {vocab})")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stop = set(eos_token_ids or ())
    dev = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=dev)
    past, out = None, []
    for _ in range(max_new_tokens):
        res = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        tok = int(torch.argmax(res.logits[0, -1]))
        out.append(tok)
        if tok in stop:
            break
        ids = torch.tensor([[tok]], dtype=torch.long, device=dev)
    return out
