"""pipeline: one module, end to end.

Takes a module and an example call; runs trace, canon, the planning passes (match, group,
grow, lower, emit, validate, place: :mod:`~fuser.pipeline.passes`) and returns a
:class:`~fuser.pipeline.fuse_module.Plan` (fused forward, guard, report), which
:func:`~fuser.pipeline.fuse_module.apply_plan` installs.
"""
