"""Speculative sampling is lossless at the runtime level: on a tiny vocabulary, the joint law
of the first three generated tokens under EAGLE (tree and chain), DDTree (DFlash drafts
verified as a tree) and n-gram trees (temperature 1.5) matches the target's exact law,
computed by enumeration with HF transformers on the same checkpoint.

False-alarm rate: the chi-square test rejects at p < 1e-4, so a correct runtime fails with
probability 1e-4 per fresh seed (the seed is fixed here, so the test is deterministic).

Target and drafter run on the test run's ``--backend`` (``tests/runtime_backend.py``); the
4000-request batch is skipped in Triton's CPU interpreter (one program per request).
"""
import itertools

import pytest
import torch
from scipy.stats import chi2

from runtime_backend import make_engine, skip_if_interpreted
from specattn.spec_runtime.engine import SpecConfig
from specattn.spec_runtime.loader import LlamaConfig, load_hf_dir, write_random_hf_dir
from specattn.spec_runtime.sampling import SamplingParams, logits_to_probs

V, N, TEMP = 5, 4000, 1.5
PROMPT = [1, 3, 0, 2]


def exact_law(hf, params):
    """{(t1, t2, t3): probability} of target-only sampling."""
    law = {}
    with torch.no_grad():
        def probs(prefix):
            return logits_to_probs(hf(torch.tensor([prefix])).logits[0, -1:], params)[0].double()
        p1 = probs(PROMPT)
        for a in range(V):
            p2 = probs(PROMPT + [a])
            for b in range(V):
                p3 = probs(PROMPT + [a, b])
                for c in range(V):
                    law[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return law


@pytest.mark.parametrize("spec", [SpecConfig("eagle", 2, 3, 5, 2), SpecConfig("eagle", 1, 2, 3, 1),
                                  SpecConfig("dflash", topk=2, num_draft_tokens=5, block_size=4),
                                  SpecConfig("ngram", topk=2, num_steps=2, ngram_size=2)],
                         ids=["eagle-tree", "eagle-chain", "ddtree", "ngram"])
def test_speculative_sampling_matches_target_law(tmp_path, spec, backend_name):
    skip_if_interpreted(backend_name, f"a batch of {N} requests runs one interpreted program per "
                                      f"request and head, for every layer and step (hours)")
    from specattn.spec_runtime.loader import load_hf_oracle
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=False, eos_token_ids=[])
    path = write_random_hf_dir(tmp_path, cfg, seed=7)
    cfg, w = load_hf_dir(path)
    params = SamplingParams(temperature=TEMP, max_new_tokens=3, seed=1234)
    eng = make_engine(backend_name, cfg, w, spec=spec, max_batch=N, max_context=16)
    res = eng.generate([PROMPT] * N, params)
    counts = {}
    for toks in res.tokens:
        assert len(toks) == 3
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    law = exact_law(load_hf_oracle(path), params)
    assert abs(sum(law.values()) - 1) < 1e-6
    # chi-square over cells with expected count >= 5; the rest pooled into one cell
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in law.items():
        e, o = N * p, counts.get(cell, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            dof += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        dof += 1
    assert dof >= 5, "too few populated cells for a meaningful test"
    pval = chi2.sf(stat, dof)
    assert pval > 1e-4, f"chi2={stat:.1f} dof={dof} p={pval:.2e}"
    # the drafts were really used: some rounds accepted at least one draft
    assert any(a > 0 for per in res.accept_lengths for a in per)
