"""install: the fused graph, put back into the eager module in place.

Takes the traced graph and the validated kernels; builds the fused graph (each region one
launcher call, copies PyTorch must make as fuser's copy kernel, the static cache written by one
kernel, kernels shared once per forward) and splices it into the module behind a guard
(:mod:`~fuser.install.splice`); ``restore`` undoes it.
"""
