"""tools: what the ``fuser`` command runs besides apply, explain and check — the CLI
(:mod:`~fuser.tools.cli`), benchmarks (:mod:`~fuser.tools.bench`), sglang's capture protocol as a
harness (:mod:`~fuser.tools.capture`), profiling and pattern suggestions
(:mod:`~fuser.tools.profile`) and launch-table tuning (:mod:`~fuser.tools.tune`).
"""
