"""Every registered bench case through pytest-benchmark (``pytest bench --benchmark-only``).

pytest-benchmark's own statistics are host wall times of one graph replay (or eager call)
followed by ``torch.cuda.synchronize()``; the device-timed figures (event median, GB/s,
TFLOP/s, % of the measured ceilings) are in each benchmark's ``extra_info``.
"""
import itertools

import pytest
import torch

from specattn.bench import harness
from specattn.bench.cases import case_names, get_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: bench cases are timed on the device")]


@pytest.mark.parametrize("name", case_names())
def test_case(benchmark, ceilings, name):
    c = get_case(name)
    wl = c.build("cuda")
    prep = harness.prepare(wl)
    result = harness.summarize(name, harness.time_prepared(prep), wl.bytes, wl.flops, ceilings,
                               mode=prep.mode, note=prep.note, flush_l2=prep.flush is not None)
    benchmark.extra_info.update(result.to_dict())
    runners = itertools.cycle(prep.runners)

    def setup():
        if prep.flush is not None:
            prep.flush()
        torch.cuda.synchronize()
        return (next(runners),), {}

    def run(runner):
        runner()
        torch.cuda.synchronize()

    benchmark.pedantic(run, setup=setup, rounds=harness.MIN_ITERS, warmup_rounds=2)
    assert result.median_us > 0
