"""trace: a module's forward as a torch.fx graph, outside Dynamo.

Takes a module and one example call; returns a :class:`~fuser.trace.tracing.Traced`: the
graph with the token dim symbolic (one trace for every batch size), heavy ops, untraceable code
and compiled code as opaque leaves, the call's state reads, and the graph rewrites made at
trace time (in-place idioms as one op, attention calls reading grouped heads). A trace that
cannot be made raises :class:`~fuser.trace.refusal.TraceRefused` naming the user's file and line.
"""
