"""Exploration (session 10): session 9's ``explore_s9.py`` driver (inputs, checks, timer,
``--trace``) on this session's scratch kernels ``alt_kernel/attention_sm90_<stem>.py``
(``alt``, ``asmbar``, ``tma``), rebuilt first from this folder's diffs (README, "Files").

``alt:OPTS``: session 9's bits, plus 4194304: the loader copies only the first half of each
tile's keys (diagnostic, wrong output) -- the most a 2-CTA cluster sharing each tile through
distributed shared memory could save.  ``asmbar[:N]`` and ``tma`` (``tma_kernel.diff``):
see :func:`call`.  ``PAGE=64`` runs every point on pages of 64 slots.  Usage as
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
PAGE = int(os.environ.get("PAGE", "1"))
_make_s8 = explore_s9.make


def make(bs, P, n=64, H=32, Hkv=8, D=128, seed=0):
    """Session 8's inputs (``explore_s9.make``); with ``PAGE`` > 1 the slots come in pages of
    ``PAGE`` consecutive slots, the pages in random order (the pools' page layout)."""
    if PAGE == 1:
        return _make_s8(bs, P, n=n, H=H, Hkv=Hkv, D=D, seed=seed)
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_req = -(-(P + n) // PAGE)
    pages = torch.randperm(bs * per_req, device="cuda", generator=g).view(bs, per_req)
    pos = torch.arange(P + n, device="cuda")
    slots = (pages[:, pos // PAGE] * PAGE + pos % PAGE).int()
    q, k, v, _, rpi, seq, qo, tm, n = _make_s8(bs, P, n=n, H=H, Hkv=Hkv, D=D, seed=seed)
    k = torch.randn(bs * per_req * PAGE, Hkv, D, dtype=k.dtype, device="cuda", generator=g)
    v = torch.randn_like(k)
    return q, k, v, slots, rpi, seq, qo, tm, n


explore_s9.make = make


def call(a, variant, splits, trace=None):
    """``asmbar[:N]``: the package kernel with mbarrier waits / arrives as inline PTX, without
    the warpgroup ``bar.sync`` Gluon puts before each; N (default 7) picks which: 1 the
    compute warpgroups' waits (every thread polls), 2 their arrivals (one per warp, counts x4),
    4 the loader's wait and ``cp.async`` arrival, 8 the compute arrivals from one thread of
    the warpgroup (counts unchanged).  ``tma``: the package kernel whose loader copies a
    whole 64-key tile at a multiple of 64 keys by TMA when ``PAGE`` (environment, the pages'
    size, default 1) is a multiple of 64; ``fma``: the package kernel (TMA as ``tma``) with
    the scale folded into the exponent's FFMA; ``pkg``: the package kernel given
    ``page_size=PAGE`` (``default`` runs it with page 1's gather).  Anything else as
    ``explore_s9.call``."""
    if variant is None or not variant.startswith(("asmbar", "tma", "fma", "pkg")):
        return _call_s9(a, variant, splits, trace)
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    A = explore_s9.A
    if variant == "pkg":
        A.sm90_tree_verify = functools.partial(explore_s9.orig, page_size=PAGE)
    elif variant in ("tma", "fma"):
        A.sm90_tree_verify = functools.partial(_scratch(variant).sm90_tree_verify, page_size=PAGE)
    else:
        asm = int(variant.split(":")[1]) if ":" in variant else 7
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
