"""Exploration (session 10): session 9's ``explore_s9.py`` driver (inputs, checks, timer,
``--trace``) on this session's scratch kernels, rebuilt first with ``mkdir -p alt_kernel``
and ``patch -o alt_kernel/attention_sm90_<stem>.py ../../../triton_kernels/attention_sm90.py
<diff>`` for (``alt``, ``alt_kernel.diff``) and (``asmbar``, ``asmbar_kernel.diff``).

``alt:OPTS``: session 9's bits, plus 4194304: the loader copies only the first half of each
tile's keys (diagnostic, wrong output) -- the most a 2-CTA cluster sharing each tile through
distributed shared memory could save.  ``asmbar[:N]``: see :func:`call`.  Usage as
``explore_s9.py``."""
import functools
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-11-22-h100-session9"))
import explore_s9  # noqa: E402


def _scratch(stem):
    """This session's scratch kernel ``alt_kernel/attention_sm90_<stem>.py`` as a module."""
    name = f"specattn.triton_kernels.attention_sm90_{stem}"
    if name not in sys.modules:
        path = os.path.join(HERE, "alt_kernel", f"attention_sm90_{stem}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


explore_s9._alt = lambda: _scratch("alt")
_call_s9 = explore_s9.call


def call(a, variant, splits, trace=None):
    """``asmbar[:N]``: the package kernel with mbarrier waits / arrives as inline PTX, without
    the warpgroup ``bar.sync`` Gluon puts before each; N (default 7) picks which: 1 the
    compute warpgroups' waits (every thread polls), 2 their arrivals (one per warp, counts x4),
    4 the loader's wait and ``cp.async`` arrival, 8 the compute arrivals from one thread of
    the warpgroup (counts unchanged).  Anything else as ``explore_s9.call``."""
    if variant is None or not variant.startswith("asmbar"):
        return _call_s9(a, variant, splits, trace)
    asm = int(variant.split(":")[1]) if ":" in variant else 7
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    A = explore_s9.A
    A.sm90_tree_verify = functools.partial(_scratch("asmbar").sm90_tree_verify, asm=asm)
    try:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 check_bounds=False)
    finally:
        A.sm90_tree_verify = explore_s9.orig


explore_s9.call = call

if __name__ == "__main__":
    src = open(explore_s9.__file__).read()
    main = src[src.index('if __name__ == "__main__":'):].replace('if __name__ == "__main__":', "if True:", 1)
    exec(compile(main, explore_s9.__file__, "exec"), vars(explore_s9))
