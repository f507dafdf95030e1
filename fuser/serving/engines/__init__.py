"""engines: one adapter per serving engine, holding only what is that engine's (its hooks,
class names, per-call state, leaves, flags and options) and describing it in one
:class:`fuser.serving.engine.Engine`; the rest is :mod:`fuser.serving`. A new engine (vLLM) is
one new file here.

- :mod:`~fuser.serving.engines.sglang`: the sglang plugin (``FUSER_ENABLE=1``);
- :mod:`~fuser.serving.engines.sglang_seam`: fuser in place of sglang's ``compile_in_capture_mode``.
"""
