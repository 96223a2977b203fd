"""specattn's bench harness (installed as ``specattn.bench``).

- :mod:`.cases`: the case registry (``@case(name, description, **params)`` on a setup function
  returning a :class:`~.cases.Workload`) and the cases;
- :mod:`.harness`: CUDA timing (events around graph replays or eager calls, input rotation or
  L2 flush), the measured ceilings, and the statistics;
- :mod:`.runner`: runs cases and reports them as a rich table and JSON.

Run with ``specattn bench [CASE...] [--json PATH]`` or ``pytest bench --benchmark-only``.
"""
