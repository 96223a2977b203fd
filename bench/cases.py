"""The bench case registry, and the cases.

A case is a name, a one-line description, default parameters, a setup function
``setup(device, **params) -> Workload`` and, optionally, a check ``check(**params)`` that
raises ValueError for parameters the setup cannot build, without building anything (no
device, no allocation): :meth:`Case.validate` runs it, so ``specattn bench -p KEY=VALUE``
refuses a bad value before it looks for a GPU, and :meth:`Case.build` runs it before the
setup. Adding a case takes a few lines::

    def _check_my_op(*, tokens, width):
        positive_ints(tokens=tokens, width=width)

    @case("my_op", "what it times, at which sizes", check=_check_my_op, tokens=256, width=576)
    def _my_op(device, *, tokens, width):
        x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
        return Workload(fn=lambda: my_op(x), bytes=2 * x.nbytes, flops=0)

Stack several ``@case`` decorators on one setup function for variants that differ only in
their parameters (as ``kv_move_reference`` / ``kv_move_reference_mha`` below).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from specattn.ops import registry
from specattn.ops.fp8 import FLOAT_DTYPES


@dataclass
class Workload:
    """What one case times.

    Attributes:
        fn: the callable to time. Called with no arguments when ``input_sets`` is None,
            otherwise as ``fn(*input_sets[i])`` for the input set ``i`` in turn.
        bytes: device-memory bytes one call must move at least (each input read once, each
            output written once), for GB/s.
        flops: floating-point operations per call (0 for pure data movement), for TFLOP/s.
        input_sets: optional list of argument tuples to rotate through, so that successive
            timed calls touch different memory and the L2 cache is not what gets timed.
        state: tensors or values the setup exposes for correctness checks (not timed).
    """
    fn: Callable[..., Any]
    bytes: int
    flops: int = 0
    input_sets: Optional[Sequence[tuple]] = None
    state: Dict[str, Any] = field(default_factory=dict)

    def calls(self) -> List[Callable[[], Any]]:
        """One zero-argument callable per input set (just ``[fn]`` without input sets)."""
        if not self.input_sets:
            return [self.fn]
        return [functools.partial(self.fn, *args) for args in self.input_sets]


@dataclass(frozen=True)
class Case:
    """A registered bench case; ``params`` are the defaults passed to ``setup`` (and to
    ``check``, when the case has one: see the module docstring)."""
    name: str
    description: str
    setup: Callable[..., Workload]
    params: Dict[str, Any] = field(default_factory=dict)
    check: Optional[Callable[..., None]] = None

    def validate(self, **overrides) -> Dict[str, Any]:
        """The default params updated by ``overrides``, checked without building anything
        (no device is needed).

        Raises:
            ValueError: an override names a parameter the case does not have, or the case's
                ``check`` refuses the params (its message names the parameter and the value).
        """
        unknown = sorted(set(overrides) - set(self.params))
        if unknown:
            raise ValueError(f"case {self.name!r} has no parameter(s) {unknown}; "
                             f"its parameters are {sorted(self.params)}")
        params = {**self.params, **overrides}
        if self.check is not None:
            self.check(**params)
        return params

    def build(self, device="cuda", **overrides) -> Workload:
        """Run ``setup`` on ``device`` with the default params updated by ``overrides``,
        after :meth:`validate`.

        Raises:
            ValueError: as :meth:`validate`; the setup may raise more (e.g. an implementation
                that needs a CUDA device).
        """
        return self.setup(torch.device(device), **self.validate(**overrides))


CASES: Dict[str, Case] = {}


def case(name: str, description: str, *, check: Optional[Callable[..., None]] = None,
         **params) -> Callable:
    """Decorator registering ``setup`` as case ``name`` with default ``params`` and the
    optional ``check`` of those params (``check`` is therefore no parameter name).

    Raises:
        ValueError: ``name`` is already registered.
    """
    def register(setup: Callable[..., Workload]) -> Callable[..., Workload]:
        if name in CASES:
            raise ValueError(f"bench case {name!r} is already registered")
        CASES[name] = Case(name, description, setup, dict(params), check)
        return setup
    return register


def case_names() -> List[str]:
    """Registered case names, sorted."""
    return sorted(CASES)


def get_case(name: str) -> Case:
    """The case called ``name``. Raises KeyError (listing the known names) if unknown."""
    try:
        return CASES[name]
    except KeyError:
        raise KeyError(f"unknown bench case {name!r}; known: {case_names()}") from None


# --------------------------------------------------------------------------- checks
def positive_ints(**values) -> None:
    """Raise ValueError unless every value is an int >= 1 (a bool is not), naming the first
    that is not: ``bs must be an int >= 1, got 0``."""
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be an int >= 1, got {v!r}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``, naming them:
    ``impl must be one of auto | cuda, got 'x'``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {' | '.join(map(str, choices))}, got {value!r}")


def torch_dtype(name: str, value: Any, allowed: Sequence[torch.dtype]) -> torch.dtype:
    """``torch.<value>`` when ``value`` names one of the dtypes ``allowed``; else ValueError
    naming them: ``index_dtype must be one of int32 | int64, got 'x'``."""
    dt = getattr(torch, value, None) if isinstance(value, str) else None
    if dt not in allowed:
        names = [str(d).replace("torch.", "") for d in allowed]
        raise ValueError(f"{name} must be one of {' | '.join(names)}, got {value!r}")
    return dt


# --------------------------------------------------------------------------- cases


def kv_move_inputs(tokens: int, input_sets: int, device, index_dtype=torch.int64,
                   seed: int = 0) -> List[tuple]:
    """``input_sets`` pairs ``(tgt_loc, src_loc)``, each ``[tokens]`` of ``index_dtype`` on
    ``device``; all slots are distinct (within and across sets) and drawn at random from
    ``range(input_sets * 2 * tokens)``."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(input_sets * 2 * tokens, generator=g)
    out = []
    for i in range(input_sets):
        chunk = perm[i * 2 * tokens:(i + 1) * 2 * tokens]
        out.append((chunk[:tokens].to(device, index_dtype), chunk[tokens:].to(device, index_dtype)))
    return out


KV_MOVE_IMPLS = ("auto",) + registry.IMPLS + ("floor",)
"""``impl`` of the ``kv_move*`` cases: ``move_kv_cache``'s, or ``floor`` (one plain copy)."""


def _check_kv_move(*, layers, kv_per_layer, heads, width, tokens, input_sets, dtype, impl,
                   group_size):
    positive_ints(layers=layers, kv_per_layer=kv_per_layer, heads=heads, width=width,
                  tokens=tokens, input_sets=input_sets)
    torch_dtype("dtype", dtype, FLOAT_DTYPES)
    check_choice("impl", impl, KV_MOVE_IMPLS)
    if group_size is not None:
        positive_ints(group_size=group_size)


@case("kv_move_reference",
      "reference move_kv_cache, MLA-like: 61 layers x [slots,1,576] bf16, 256 tokens moved",
      check=_check_kv_move,
      layers=61, kv_per_layer=1, heads=1, width=576, tokens=256, input_sets=8,
      dtype="bfloat16", impl="reference", group_size=None)
@case("kv_move_reference_mha",
      "reference move_kv_cache, MHA: 32 layers x K,V x [slots,8,128] bf16, 256 tokens moved",
      check=_check_kv_move,
      layers=32, kv_per_layer=2, heads=8, width=128, tokens=256, input_sets=8,
      dtype="bfloat16", impl="reference", group_size=None)
@case("kv_move_mla",
      "move_kv_cache (auto impl, one-launch direct path: group_size=1), MLA-like: 61 layers x "
      "[slots,1,576] bf16, 256 tokens moved",
      check=_check_kv_move,
      layers=61, kv_per_layer=1, heads=1, width=576, tokens=256, input_sets=8,
      dtype="bfloat16", impl="auto", group_size=1)
@case("kv_move_mha",
      "move_kv_cache (auto impl, one-launch direct path: group_size=1), MHA: 32 layers x K,V x "
      "[slots,8,128] bf16, 256 tokens moved",
      check=_check_kv_move,
      layers=32, kv_per_layer=2, heads=8, width=128, tokens=256, input_sets=8,
      dtype="bfloat16", impl="auto", group_size=1)
def _kv_move(device, *, layers, kv_per_layer, heads, width, tokens, input_sets, dtype, impl,
             group_size):
    """``move_kv_cache`` over ``layers * kv_per_layer`` buffers ``[slots, heads, width]``;
    bytes = every moved row read once and written once.

    ``group_size``: passed through (``None``: the overlap-safe staged path inside CUDA graphs,
    which is what the harness times; ``1``: the one-launch direct path -- a true promise
    here, since all slots of a set are distinct and targets never meet sources).

    ``impl="floor"``: no move; ONE contiguous elementwise copy (``torch.mul(src, 1, out=dst)``,
    the kernel of the copy ceiling) of exactly the bytes the move reads and writes, timed the
    same way: the launch + bandwidth floor of any one-launch move of this size."""
    from specattn.ops import move_kv_cache

    dt = getattr(torch, dtype)
    row_bytes = heads * width * dt.itemsize
    nbytes = 2 * tokens * row_bytes * layers * kv_per_layer
    if impl == "floor":
        n = nbytes // 2 // dt.itemsize
        pairs = [(torch.randn(n, dtype=dt, device=device), torch.empty(n, dtype=dt, device=device))
                 for _ in range(input_sets)]
        return Workload(fn=lambda src, dst: torch.mul(src, 1, out=dst), bytes=nbytes, flops=0,
                        input_sets=pairs)
    slots = 2 * tokens * input_sets
    buffers = [torch.randn(slots, heads, width, dtype=dt, device=device)
               for _ in range(layers * kv_per_layer)]
    sets = kv_move_inputs(tokens, input_sets, device)

    def move(tgt_loc, src_loc):
        move_kv_cache(buffers, tgt_loc, src_loc, impl=impl, group_size=group_size)

    return Workload(fn=move, bytes=nbytes, flops=0, input_sets=sets, state={"buffers": buffers})


from . import cases_tree  # noqa: E402,F401  (registers the EAGLE tree-op cases)
from . import cases_kv_materialize  # noqa: E402,F401  (registers the kv_materialize case)
from . import cases_attention  # noqa: E402,F401  (registers the attention cases)
from . import cases_round_ops  # noqa: E402,F401  (registers the top-k, n-gram and EAGLE draft cases)
