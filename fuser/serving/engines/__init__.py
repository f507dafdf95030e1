"""engines: one adapter per serving engine — only what is that engine's (its hooks, class
names, per-call state and options); the rest is :mod:`fuser.serving`.

- :mod:`~fuser.serving.engines.sglang`: the sglang plugin (``FUSER_ENABLE=1``);
- :mod:`~fuser.serving.engines.sglang_seam`: fuser in place of sglang's ``compile_in_capture_mode``.
"""
