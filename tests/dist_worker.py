"""One rank of the multi-process drafter training test (started by torchrun from
tests/test_drafter_distributed.py; CPU, gloo).

``python dist_worker.py MODEL_DIR OUT_DIR KIND [BUDGET_S]``: the whole ``run_training`` with data
generated across the ranks (prompts from a file, self-written prompts, seeds) and trained
data-parallel; a fake tokenizer (token i <-> the letter chr(48 + i)) stands in for the
model's.  With ``BUDGET_S`` the training runs up to 100,000 steps and stops at that time
budget.  Each rank writes ``rank{r}.safetensors`` (its trained parameters) and
``rank{r}.json`` (its data and log summary)."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from specattn.spec_runtime import loader
from specattn.spec_runtime.train_drafter import GenConfig, RunOptions, TrainConfig, init_distributed, run_training


class Tok:
    chat_template = "fake"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(48 + int(i)) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 48 for c in text]


def main(model_dir: str, out_dir: str, kind: str, budget_s: str = "0") -> None:
    torch.set_num_threads(1)
    loader.load_tokenizer = lambda path: Tok()
    loader.chat_user_prefix_ids = lambda tok: [5, 6, 7]
    loader.apply_chat_template = lambda tok, text: [5, 6, 7] + tok.encode(text) + [8]
    ctx, dev = init_distributed("cpu")
    out = Path(out_dir)
    prompts = out / "prompts.txt"
    if ctx.is_main:
        prompts.write_text("ABC\nDEFG\nHI\nJKLMN\nOP\n")
    import torch.distributed as dist
    dist.barrier()
    gen = GenConfig(gen_batch=4, max_new_tokens=10, samples_per_prompt=2, seed_max_new_tokens=8,
                    self_prompts=9, self_prompt_max_tokens=10, seed=4)
    extra = (dict(block_size=4, draft_layers=1, num_context_layers=2, num_anchors=4, max_checkpoint_mib=0)
             if kind == "dflash" else dict(ttt_steps=2))
    budget = float(budget_s)
    tc = TrainConfig(kind=kind, seq_len=24, batch_size=2, steps=100_000 if budget else 12, lr=3e-3, warmup_steps=2,
                     eval_every=5, eval_batches=1, time_budget_s=budget, amp=False, seed=5, eval_frac=0.2, **extra)
    res = run_training(RunOptions(out=out / "drafter", model=model_dir, prompts=prompts,
                                  data=out / "data.safetensors", num_seeds=3, device=dev, gen=gen, train=tc,
                                  progress=False, dist=ctx))
    params = {k: v.detach().float().contiguous() for k, v in res["drafter"].trainable_parameters().items()}
    save_file(params, str(out / f"rank{ctx.rank}.safetensors"))
    log = res["log"]
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({
        "files": sorted(str(p) for p in res["files"].values()), "data_stats": res["data_stats"],
        "steps_done": log["steps_done"], "stop_reason": log["stop_reason"], "world_size": log["world_size"],
        "rows_per_step": log["rows_per_step"],
        "evals": len(log["eval"]), "final_eval": log["final_eval"] is not None,
        "losses": [e["loss"] for e in log["train"]]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
