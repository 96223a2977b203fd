"""FlashInfer's prefix + tree split with its fa3 backend next to the fa2 anchor (session 12).

The bench's ``flashinfer_split`` builds its wrappers with ``fi_backend="fa2"`` (what SGLang
passes); ``fi_backend="auto"`` lets FlashInfer 0.7.2 pick fa3 on Hopper for the mask-free
prefix prefill (the draft part keeps its custom mask).  This times both, and the package's
kernel, at the issue's four tree-verify points at page 1, through the bench's own case and
timer (``specattn.bench.runner.run_case``: CUDA graph, median of 100), in two passes so that
drift shows.  Usage (GPU machine, after ``source .device/setup.sh``):
``python fi_backends.py``."""
import torch

from specattn.bench import harness, runner
from specattn.bench.attention_report import TREE_POINTS

IMPLS = (("triton", {}), ("flashinfer_split", {"fi_backend": "fa2"}),
         ("flashinfer_split", {"fi_backend": "auto"}))

if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    ceilings = harness.measure_ceilings()
    for rnd in range(2):
        for bs, prefix in TREE_POINTS:
            row = []
            for impl, extra in IMPLS:
                r = runner.run_case("tree_verify", dict(bs=bs, prefix=prefix, impl=impl, **extra),
                                    ceilings)
                row.append(f"{impl}{'/' + extra['fi_backend'] if extra else ''} "
                           f"{r['median_us']:.1f}")
            print(f"pass {rnd} bs{bs} P{prefix}: " + "  ".join(row), flush=True)
