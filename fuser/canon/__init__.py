"""canon: a canonical op (:class:`~fuser.ir.canonical_op.COp`) for every node of a traced graph.

Takes a :class:`~fuser.trace.tracing.Traced`; returns ``{node: COp}``: each spelling of an op
(``x*x``, ``x.pow(2)``, ``x.square()``; ``view``/``reshape``) as one op with its arguments bound,
and its kind (compute, view, heavy, mutation, ...), which every later stage reads.

:mod:`~fuser.canon.canonicalize` classifies each node; an op with a rule of its own is
canonicalised by the function registered under its name with ``@canonical(name)``
(:mod:`~fuser.canon.registry`) in its family's module (:mod:`~fuser.canon.views`,
:mod:`~fuser.canon.ops`).
"""
