"""validate: each kernel against eager, on the values of one eager run of the module.

Takes the kernels and the traced module; returns, per kernel, None or why it disagrees,
within the tolerance of its least precise dtype (:mod:`~fuser.validate.tolerance`).
"""
