"""Drafter training on several processes (``torchrun``; here 2 CPU processes over gloo):
the ranks share the data generation and train data-parallel, and end with the same weights."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specattn.spec_runtime.loader import LlamaConfig, write_random_hf_dir
from specattn.spec_runtime.train_drafter import (DistContext, GenConfig, SequenceData, gather_sequence_data,
                                                 generate_data_sharded, init_distributed, merge_rank_meta,
                                                 shard_share)

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_distributed_single_process_and_errors(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert init_distributed("cpu") == (DistContext(), "cpu")
    assert init_distributed("cuda:1") == (DistContext(), "cuda:1")     # one process: untouched
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed("cpu")[0].world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="--device cuda"):
        init_distributed("cuda:1")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="do not fit"):
        init_distributed("cpu")
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="integers"):
        init_distributed("cpu")


def test_shard_share_and_gather():
    for n in range(0, 9):
        for w in (1, 2, 3, 4):
            shares = [shard_share(n, DistContext(r, w, r)) for r in range(w)]
            assert sum(shares) == n and max(shares) - min(shares) <= 1
            assert shares == [len(list(range(n))[r::w]) for r in range(w)]
    # two parts -> one, ordered by kind then group; tokens and masks travel with their sequence
    a = SequenceData.from_sequences([[1, 2, 3], [4, 5]], [1, 1], [1, 0], [2, 0])
    b = SequenceData.from_sequences([[6, 7, 8, 9]], [2], [0], [1])
    m = gather_sequence_data([a, b], {"x": 1})
    assert m.kind.tolist() == [0, 0, 1] and m.group.tolist() == [0, 1, 2]
    assert m.tokens.tolist() == [4, 5, 6, 7, 8, 9, 1, 2, 3] and m.offsets.tolist() == [0, 2, 6, 9]
    assert m.loss_mask.tolist() == [False, True, False, False, True, True, False, True, True]
    assert m.meta == {"x": 1}
    empty = gather_sequence_data([], {})
    assert empty.num_sequences == 0 and empty.tokens.dtype == torch.int32
    metas = [{"n": 3, "s": 1.5, "x": "a", "truncated_by_time_budget": False},
             {"n": 4, "s": 2.5, "x": "b", "truncated_by_time_budget": True}]
    assert merge_rank_meta(metas, ("n",), ("s",)) == {"n": 7, "s": 2.5, "x": "a", "truncated_by_time_budget": True}
    assert merge_rank_meta(metas[:1], ("n",), ("s",)) == metas[0]
    # more processes than prompts and seeds: every rank raises before any collective
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    for r in range(4):
        with pytest.raises(ValueError, match="a rank would have none"):
            generate_data_sharded(cfg, {}, [[1, 2], [3]], [[4]], gen=GenConfig(), seq_len=8,
                                  ctx=DistContext(r, 4, r), progress=False)


def _launch(tmp_path, kind, *extra):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      eos_token_ids=list(range(0, 96, 7)))
    model_dir = write_random_hf_dir(tmp_path / "target", cfg, seed=3)
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(HERE / "dist_worker.py"), str(model_dir), str(out), kind, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    info = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    p0, p1 = (load_file(str(out / f"rank{i}.safetensors")) for i in range(2))
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
    return out, info


@pytest.mark.slow
def test_two_process_time_budget(tmp_path):
    """A time budget ends the run on both ranks at the same step, with the same weights: each
    rank's clock differs, so they agree on the re-planned schedule (the shortest) and on the
    budget's stop (the earliest)."""
    _, info = _launch(tmp_path, "dflash", "2.0")
    assert info[0]["stop_reason"] == info[1]["stop_reason"]
    assert 0 < info[0]["steps_done"] == info[1]["steps_done"] < 100_000


@pytest.mark.parametrize("kind", ["dflash", pytest.param("eagle3", marks=pytest.mark.slow)])
def test_two_process_training(tmp_path, kind):
    """Data generated across 2 ranks (file prompts, self-written prompts and seeds dealt
    round-robin, sampled with per-rank seeds) is one data set with the single-process group
    numbering on both ranks; data-parallel training ends with identical weights on both ranks
    (each rank trains on different rows, so without the gradient all-reduce they would
    differ); rank 0 alone exports and evaluates."""
    out, info = _launch(tmp_path, kind)
    assert info[0]["data_stats"] == info[1]["data_stats"]
    for i in info:
        assert i["world_size"] == 2 and i["rows_per_step"] == 4 and i["steps_done"] == 12
    assert info[0]["final_eval"] and info[0]["evals"] == 2 and not info[1]["final_eval"] and info[1]["evals"] == 0
    assert any(f.endswith("model.safetensors") for f in info[0]["files"]) and info[1]["files"] == []
    assert sorted(p.name for p in (out / "drafter").iterdir())[:2] == ["README.md", "config.json"]
    card = (out / "drafter" / "README.md").read_text()
    assert "batch 4 rows (2 processes, data-parallel) x 24 tokens" in card and "float32 on 2 processes, max" in card
    losses = info[0]["losses"]
    assert losses[-1] < losses[0]
    data = SequenceData.load(out / "data.safetensors")
    meta = data.meta
    n_prompts = meta["prompts"]
    assert meta["world_size"] == 2 and meta["file_prompts"] == 5 and n_prompts == 5 + meta["self_prompts"]["kept"]
    assert meta["self_prompts"]["requested"] == 9 and meta["seeds"] == 3
    assert sorted(set(data.group.tolist())) == list(range(n_prompts + 3))
    st = data.stats()
    assert (st["greedy_sequences"], st["sampled_sequences"], st["seed_sequences"]) == (n_prompts, 2 * n_prompts, 3)
    # every sequence of a group starts with that group's prompt: the file's prompts are groups 0-4
    heads = {}
    for i in range(data.num_sequences):
        s, e = int(data.offsets[i]), int(data.offsets[i + 1])
        head = tuple(data.tokens[s:e][~data.loss_mask[s:e]].tolist())
        g = int(data.group[i])
        if int(data.kind[i]) != 2:
            head = head[:head.index(8) + 1] if 8 in head else head
            assert heads.setdefault(g, head) == head
    files = ["ABC", "DEFG", "HI", "JKLMN", "OP"]
    for g, text in enumerate(files):
        assert heads[g] == tuple([5, 6, 7] + [ord(c) - 48 for c in text] + [8])
    assert len(set(heads.values())) == n_prompts                     # distinct prompts, one group each
