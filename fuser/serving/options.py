"""options: what the serving integration does (:class:`Options`), read from the ``FUSER_*``
environment variables, which an engine's worker processes inherit. An adapter's options (its
default layer classes, its own variables) are a subclass that extends :meth:`Options.env_fields`."""

from __future__ import annotations

import os
from dataclasses import dataclass


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(environ, name: str, default: bool = False) -> bool:
    """``environ[name]`` read as a boolean; unset or empty gives ``default``."""
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={environ[name]!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def env_names(environ, name: str, separator: str = ",") -> tuple[str, ...]:
    return tuple(x.strip() for x in environ.get(name, "").split(separator) if x.strip())


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
        )

    def apply_options(self) -> dict:
        """The keyword arguments of :func:`fuser.apply` these options give."""
        options = {} if self.precompute else {"precompute": False}
        if self.patterns:
            options["patterns"] = list(self.patterns)
        if self.leaves:
            options["leaves"] = list(self.leaves)
        return options
