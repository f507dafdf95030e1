"""model: a whole model of repeated decoder layers.

Takes a model and one example call; fuses each distinct layer structure once through the
pipeline and installs it on every layer of that structure, each checked against its own
eager forward; the model's other submodules and its own forwards are fused around them.
Returns a :class:`~fuser.model.fuse_model.ModelReport`.
"""
