"""Tiny random Llama models for the runtime's CPU tests (written as an HF directory and
loaded back through the loader, as a real checkpoint would be)."""
from __future__ import annotations

import random

from specattn.spec_runtime.loader import LlamaConfig, load_hf_dir, write_random_hf_dir

__all__ = ["tiny_llama", "random_prompts"]


def tiny_llama(tmp_path, seed: int, *, vocab: int = 96, hidden: int = 64, layers: int = 4,
               heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    """``(config, weights)`` of a random tied-embedding Llama without EOS ids."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=True,
                      eos_token_ids=[])
    return load_hf_dir(write_random_hf_dir(tmp_path, cfg, seed=seed % 100000))


def random_prompts(seed: int, vocab: int, n: int = 3, max_len: int = 12):
    """``n`` prompts of 1..``max_len`` random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]
