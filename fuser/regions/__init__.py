"""regions: the glue grouped into regions, each to become one kernel.

Takes the canonical graph and the pattern matches; returns :class:`~fuser.regions.builder.Region`
objects (the nodes a kernel computes, its inputs and outputs, its place in the program), grown
where the larger region still has a place to run (:mod:`~fuser.regions.growth`).
"""
