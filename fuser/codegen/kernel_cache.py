"""kernel_cache: where rendered kernels are written, and how they are loaded.

What runs is the source text :mod:`fuser.codegen.emit` rendered in this process, nothing read
back from the cache directory:

- The text is compiled and executed as it is (:func:`load`); no file loader, no ``.pyc``. A
  ``__pycache__/*.pyc`` planted beside a kernel, or a file swapped after it was written, is
  never executed. The text is registered with :mod:`linecache` under the file's path, so
  Triton's ``@jit`` (and the interpreter, ``inspect.getsource`` and tracebacks) see that very
  text, whatever the file on disk holds.
- The file is a readable copy of it (``kernels/`` diffs like source). Each :func:`store`
  compares the file with the text and rewrites it when it differs (missing, truncated, edited,
  swapped), by writing a new file and renaming it over the old one: a reader sees the whole of
  one version or the other, never a mix. Two processes storing the same kernel write the same
  text, so whichever rename lands last leaves the same file; no lock is needed.
- Files are created with mode 0666 less the umask (and the directory's default ACL): a cache
  directory shared by a group works as the umask allows. A directory that already holds every
  kernel a model needs may be read-only.

Every error about the directory names it and ``$FUSER_KERNEL_DIR`` (:class:`KernelCacheError`).
"""

from __future__ import annotations

import linecache
import os
import secrets
import types
from pathlib import Path

from fuser.pattern import PACKAGE_DIR

DIR_ENV = "FUSER_KERNEL_DIR"


class KernelCacheError(OSError):
    """The kernel cache directory, or a kernel file in it, cannot be created, read or written."""


def kernel_dir() -> Path:
    """Where rendered kernels go, created if missing; the first of:

    1. ``$FUSER_KERNEL_DIR``;
    2. the checkout's ``kernels/`` (fuser run from its source tree: a ``kernels/`` beside
       ``pyproject.toml``);
    3. ``$XDG_CACHE_HOME/fuser/kernels`` (an absolute ``$XDG_CACHE_HOME`` only, as the XDG
       spec asks);
    4. ``~/.cache/fuser/kernels``.
    """
    env = os.environ.get(DIR_ENV)
    checkout = PACKAGE_DIR.parent
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if env:
        path = Path(env)
    elif (checkout / "kernels").is_dir() and (checkout / "pyproject.toml").exists():
        path = checkout / "kernels"
    elif os.path.isabs(xdg):
        path = Path(xdg) / "fuser" / "kernels"
    else:
        path = Path.home() / ".cache" / "fuser" / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelCacheError(_directory_problem(path, f"cannot create it ({e.strerror or e})")) from e
    return path


def store(path: Path, source: str) -> None:
    """Make the file ``path`` hold ``source``: left alone if it does, else written anew and
    renamed into place."""
    try:
        if path.read_text() == source:
            return
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError):
        pass  # unreadable or not text: replaced below like any other wrong content
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # 0o666: the umask (and a default ACL) decide who else may read it, as for any new file
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(descriptor, "w") as file:
            file.write(source)
        os.replace(temporary, path)
    except OSError as e:
        temporary.unlink(missing_ok=True)
        raise KernelCacheError(_directory_problem(path.parent, f"cannot write {path.name} ({e.strerror or e})")) from e


def load(path: Path, source: str, name: str) -> types.ModuleType:
    """The module ``source`` defines, executed from that text (never from ``path``, nor from a
    ``.pyc``), with ``path`` as its file name: the text is registered in :mod:`linecache`
    under it, where ``inspect.getsource`` (and so Triton's ``@jit``) finds it."""
    filename = str(path)
    # mtime None: linecache.checkcache keeps the entry whatever happens to the file on disk
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)
    return module


def _directory_problem(directory: Path, what: str) -> str:
    source = f"${DIR_ENV}" if os.environ.get(DIR_ENV) else f"the default; set ${DIR_ENV} to choose another"
    return (
        f"kernel cache {directory} ({source}): {what}. fuser writes each kernel it renders there; "
        f"set {DIR_ENV} to a directory you may write."
    )
