"""options: the options of ``fuser.apply`` (``explain``, ``check``) completed from the ``FUSER_*``
environment variables the library reads, and the leaves they name resolved
(:func:`library_options`); the environment helpers :func:`env_flag` and :func:`env_names`, which
the serving integration's options (:mod:`fuser.serving.options`) read the same variables with.

The library, the CLI (``--leaf``) and the serving plugin read the same names the same way:
``FUSER_LEAVES=a,b`` adds leaves, ``FUSER_PRECOMPUTE=0`` reads every weight live unless the call
says ``precompute=``, and a leaf name that names nothing is an error.
"""

from __future__ import annotations

import os

from fuser.pipeline.fuse_module import FuserError
from fuser.trace.leaves import UnknownLeaf, resolve_leaves

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
    """``environ[name]`` split at ``separator``, each name stripped, empty ones dropped."""
    return tuple(x.strip() for x in environ.get(name, "").split(separator) if x.strip())


def library_options(module, options: dict, environ=None) -> dict:
    """A copy of ``options`` (the keyword arguments of ``fuser.apply``) with

    * the names of ``FUSER_LEAVES=a,b`` added to ``leaves``, after the explicit ones, each leaf
      once (the serving plugin passes ``FUSER_LEAVES``'s names itself: they are not added twice);
    * ``precompute`` from ``FUSER_PRECOMPUTE`` where the call does not pass ``precompute``;
    * ``leaves`` resolved against ``module`` (:func:`fuser.trace.leaves.resolve_leaves`): a
      name that names no submodule (nor the tail of one's qualified name), module class or
      function raises :class:`~fuser.pipeline.fuse_module.FuserError`, naming it.

    Resolving twice gives the same leaves (what is resolved is taken as it is)."""
    environ = os.environ if environ is None else environ
    result = dict(options)
    explicit = result.get("leaves") or ()
    explicit = [explicit] if isinstance(explicit, str) else list(explicit)
    from_env = [n for n in env_names(environ, "FUSER_LEAVES") if n not in _strings(explicit)]
    if "precompute" not in result and environ.get("FUSER_PRECOMPUTE", "").strip():
        try:
            result["precompute"] = env_flag(environ, "FUSER_PRECOMPUTE", True)
        except ValueError as e:
            raise FuserError(str(e)) from None
    if not explicit and not from_env:
        return result
    try:
        result["leaves"] = resolve_leaves(module, [*explicit, *from_env])
    except UnknownLeaf as e:
        where = " (from FUSER_LEAVES)" if e.name in from_env else ""
        raise FuserError(f"{e}{where}") from None
    return result


def _strings(leaves: list) -> set[str]:
    return {x for x in leaves if isinstance(x, str)}
