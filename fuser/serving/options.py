"""options: what the serving integration does (:class:`Options`), read from the ``FUSER_*``
environment variables, which an engine's worker processes inherit, with the helpers the library
reads them with (:mod:`fuser.pipeline.options`). An adapter's options (its default layer
classes, its own variables) are a subclass that extends :meth:`Options.env_fields`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fuser.pipeline.options import env_flag, env_names


@dataclass(frozen=True)
class Options:
    """What the serving integration does; :meth:`from_env` reads the ``FUSER_*`` variables."""

    enable: bool = False  # FUSER_ENABLE
    layers: tuple[str, ...] = ()  # FUSER_LAYERS: decoder-layer class names (an adapter's default)
    patterns: tuple[str, ...] = ()  # FUSER_PATTERNS: extra pattern files, os.pathsep-separated
    leaves: tuple[str, ...] = ()  # FUSER_LEAVES: extra opaque leaves
    draft: bool = False  # FUSER_DRAFT: also fuse speculative-decoding draft models
    strict: bool = False  # FUSER_STRICT: raise instead of leaving a module eager
    precompute: bool = True  # FUSER_PRECOMPUTE: parameter-only glue computed once at fuse time
    explain: bool = False  # FUSER_EXPLAIN: log what is selected, and each fused module's full report
    whole_layer: bool = True  # FUSER_WHOLE_LAYER: fuse each layer whole first, its targets as the fallback

    @classmethod
    def from_env(cls, environ=None):
        environ = os.environ if environ is None else environ
        return cls(**cls.env_fields(environ))

    @classmethod
    def env_fields(cls, environ) -> dict:
        """The fields ``environ`` gives, by name; an adapter's subclass adds its own variables."""
        return dict(
            enable=env_flag(environ, "FUSER_ENABLE"),
            layers=env_names(environ, "FUSER_LAYERS") or cls().layers,
            patterns=env_names(environ, "FUSER_PATTERNS", os.pathsep),
            leaves=env_names(environ, "FUSER_LEAVES"),
            draft=env_flag(environ, "FUSER_DRAFT"),
            strict=env_flag(environ, "FUSER_STRICT"),
            precompute=env_flag(environ, "FUSER_PRECOMPUTE", True),
            explain=env_flag(environ, "FUSER_EXPLAIN"),
            whole_layer=env_flag(environ, "FUSER_WHOLE_LAYER", True),
        )

    def apply_options(self) -> dict:
        """The keyword arguments of :func:`fuser.apply` these options give."""
        options = {} if self.precompute else {"precompute": False}
        if self.patterns:
            options["patterns"] = list(self.patterns)
        if self.leaves:
            options["leaves"] = list(self.leaves)
        return options
