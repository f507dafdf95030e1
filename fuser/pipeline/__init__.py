"""pipeline: one module, end to end.

Takes a module and an example call; runs the steps of :mod:`~fuser.pipeline.pass_list` in
order (trace and its rewrites, canon, the planning passes of :mod:`~fuser.pipeline.passes`:
match, group, grow, validate, place; then the fused graph), each switchable by name where a
fused forward can do without it, and returns a :class:`~fuser.pipeline.fuse_module.Plan`
(fused forward, guard, report), which :func:`~fuser.pipeline.fuse_module.apply_plan` installs.
"""
