"""serving: fuser inside a serving engine, lazily and never inside a CUDA-graph capture.

Engine-neutral: the adapter interface and installing it over a model's layers
(:mod:`~fuser.serving.engine`), the mode splice and lazy fusion at a layer's first decode call
(:mod:`~fuser.serving.lazy_fusion`), which submodules are fused (:mod:`~fuser.serving.targets`),
the closure seam (:mod:`~fuser.serving.closures`), engine-wide flags read as guarded values
(:mod:`~fuser.serving.global_reads`) and the options (:mod:`~fuser.serving.options`). An engine's
adapter is one file in :mod:`fuser.serving.engines`: one :class:`~fuser.serving.engine.Engine`
and the engine's hooks.
"""
