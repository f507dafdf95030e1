"""ir: the vocabulary every stage shares, importing nothing of fuser's.

- :mod:`~fuser.ir.ops`: the op table — each PyTorch op fuser knows, its kind and its spellings;
- :mod:`~fuser.ir.canonical_op`: :class:`COp`, the canonical op canon gives every node, the
  kinds a node can be, and small readers of fx nodes;
- :mod:`~fuser.ir.opaque`: ``@fuser.opaque``, what stays one call in the trace;
- :mod:`~fuser.ir.report`: what fuser did to a module, as data (the ``explain`` output).
"""
