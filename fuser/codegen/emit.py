"""emit: render a fused Triton kernel from a Jinja template, keep it in the kernel cache, run it.

Kernel files are content-addressed (the name carries a hash of the template and everything
rendered into it) and start with a header naming the template, the pattern and its
parameters, so ``kernels/`` reads and diffs like source. The same chain with the same
parameters always renders the same file. Where the files go and how a kernel is loaded (from
the rendered text, never from the file) is :mod:`fuser.codegen.kernel_cache`.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jinja2

from fuser.codegen.capture_guard import capturing
from fuser.codegen.fast_launch import fast
from fuser.codegen.kernel_cache import kernel_dir, load, store
from fuser.codegen.launch_config import current_gpu, lookup
from fuser.lower.warps import warps_for
from fuser.lower.row_program import TL_DTYPES, Operand, RowProgram, row_count, row_source
from fuser.pattern import templates_dir
from fuser.lower.tiling import LAUNCH_PROGRAMS, pow2


class TemplateError(Exception):
    """A template that does not load or render; the message starts with ``file:line:``."""


@dataclass
class KernelSpec:
    template: str
    pattern: str  # the pattern's name, or "generic"
    inputs: list[Operand]
    outputs: list[Operand]
    params: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    program: RowProgram | None = None
    warps: int | None = None  # set by the launch-config tuner; else the table, else the heuristic
    pdl: bool = False  # a row program launched with programmatic dependent launch (fuser.pipeline.passes.launch_pdl)

    @property
    def num_warps(self) -> int:
        if self.warps is not None:
            return self.warps
        if self.program is None:
            return 1
        return lookup(self, current_gpu()) or self.program.num_warps

    @property
    def tile_at_launch(self) -> bool:
        """Does each launch choose its tile width, and warps with it, by its row count
        (:func:`fuser.lower.tiling.launch_width`)? Not where warps were tuned for this kernel (a
        launch-table entry, or the tuner's own): they hold for its tile."""
        if self.program is None or not self.program.widths or self.warps is not None:
            return False
        return lookup(self, current_gpu()) is None


#: A kernel rendered for programmatic dependent launch (``KernelSpec.pdl``) is launched with it
#: at this many rows or fewer: a decode step at batch 1 gains (Llama-3.2-1B: 1137 -> 1075 µs, the
#: GPU's idle time 68 -> 8 µs); launched so at batch 8 it lost (1169 -> 1189 µs, idle 73 -> 93), its
#: early-launched programs waiting on SMs the kernel before still needs (benchmarks/results/README.md).
PDL_ROWS = 1

_ENV_LOCK = threading.Lock()
_ENV: jinja2.Environment | None = None


def environment() -> jinja2.Environment:
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = jinja2.Environment(
                loader=jinja2.FileSystemLoader(str(templates_dir())),
                undefined=jinja2.StrictUndefined,
                keep_trailing_newline=True,
            )
            _ENV.globals["pow2"] = pow2
        return _ENV


def template_names() -> set[str]:
    return {p.name[: -len(".py.jinja")] for p in templates_dir().glob("*.py.jinja") if not p.name.startswith("_")}


def load_template(name: str) -> jinja2.Template:
    try:
        return environment().get_template(f"{name}.py.jinja")
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{e.filename}:{e.lineno}: {e.message}") from None
    except jinja2.TemplateNotFound:
        raise TemplateError(f"{templates_dir()}/{name}.py.jinja: no such template") from None


def render(spec: KernelSpec, kernel_name: str) -> str:
    template = load_template(spec.template)
    context = dict(
        template=spec.template,
        pattern=spec.pattern,
        params=_format_params(spec.params),
        sizes=spec.sizes,
        inputs=spec.inputs,
        outputs=spec.outputs,
        named_outputs={op.name: op for op in spec.outputs},  # a hand-written template's outputs by name
        program=spec.program,
        kernel_name=kernel_name,
        num_warps=spec.num_warps,
        tile_at_launch=spec.tile_at_launch,
        launch_programs=LAUNCH_PROGRAMS,
        launch_warps=launch_warps(spec.program),
        row_source=row_source(spec.inputs),
        row_count=row_count(spec.inputs),
        tl_dtype=TL_DTYPES,
        pdl=spec.pdl,
        pdl_rows=PDL_ROWS,
    )
    try:
        return template.render(**context)
    except jinja2.TemplateSyntaxError as e:  # in a parent template, loaded while rendering
        raise TemplateError(f"{e.filename}:{e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        filename, line = _template_location(e, template)
        raise TemplateError(f"{filename}:{line}: {type(e).__name__}: {e}") from None


def launch_warps(program: RowProgram | None) -> dict[int, int]:
    """The warps of each tile width a launch may choose: the heuristic's for its block."""
    widths = program.widths if program is not None else ()
    return {width: warps_for(program.others * width, program.per_warp) for width in widths}


class _Params(dict):
    """Params that render as their repr (floats keep full precision) and print sorted."""

    def __str__(self):
        return ", ".join(f"{k}={v}" for k, v in sorted(self.items())) or "-"

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _format_params(params: dict) -> _Params:
    return _Params({k: (repr(v) if isinstance(v, float) else v) for k, v in params.items()})


def _template_location(error: Exception, template) -> tuple[str, int]:
    """The template file and line a render error happened at (jinja maps its frames there)."""
    import traceback

    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.endswith(".jinja"):
            return frame.filename, frame.lineno
    return template.filename, 1


def kernel_source(spec: KernelSpec) -> tuple[str, str]:
    """(file stem, source): the stem is the pattern name plus a hash of the rendered source."""
    provisional = render(spec, "KERNEL")
    digest = hashlib.sha256(provisional.encode()).hexdigest()[:12]
    stem = f"{_pattern_stem(spec.pattern)}_{digest}"
    return stem, render(spec, f"{stem}_kernel")


#: The longest pattern part of a kernel's file name (file names stop at 255 bytes).
STEM_CHARS = 64


def _pattern_stem(pattern: str) -> str:
    """A merged kernel's patterns as a file name: a run of one pattern once with its count
    (``generic_x28``), cut to ``STEM_CHARS``; the hash after it keeps names apart."""
    runs: list[list] = []
    for part in pattern.split("+"):
        if runs and runs[-1][0] == part:
            runs[-1][1] += 1
        else:
            runs.append([part, 1])
    name = "_".join(part if n == 1 else f"{part}_x{n}" for part, n in runs)
    return re.sub(r"[^0-9a-zA-Z_]", "_", name)[:STEM_CHARS]


_LOADED: dict[str, Callable] = {}
_LOAD_LOCK = threading.Lock()


def emit(spec: KernelSpec) -> tuple[Path, Callable]:
    """Render the kernel, keep its file in the kernel cache, and run the rendered text (never
    the file: :mod:`fuser.codegen.kernel_cache`); returns its file and its ``launch``."""
    stem, source = kernel_source(spec)
    path = kernel_dir() / f"{stem}.py"
    with _LOAD_LOCK:
        store(path, source)
        if stem in _LOADED:
            return path, _LOADED[stem]
        module = load(path, source, f"fuser_kernels.{stem}")
        for name, value in list(vars(module).items()):
            forbid_compile_during_capture(value, path)
            if name.startswith(f"{stem}_kernel"):  # the kernels ``launch`` launches (not the helpers they call)
                setattr(module, name, fast(value))
        launch = module.launch
        launch.__qualname__ = launch.__name__ = f"{stem}"
        _LOADED[stem] = launch
        return path, launch


class CaptureCompileError(RuntimeError):
    """A fused kernel would have been JIT-compiled inside a CUDA-graph capture."""


def forbid_compile_during_capture(kernel, path: Path) -> None:
    """Make a Triton kernel raise instead of compiling while the current stream captures.

    Triton compiles one binary per *specialisation* (integer arguments equal to 1 or divisible
    by 16, pointer alignment) at its first launch; a compile inside ``torch.cuda.graph`` would
    sync and allocate in the middle of the capture and leave a broken graph. fuser compiles
    every kernel when it validates it at apply time, and the engine's warm-ups at each captured
    shape compile any other specialisation before capturing it; this turns a specialisation that
    slipped through into a clear error. Only a cache miss pays for the check.
    """
    compile_ = getattr(kernel, "_do_compile", None)  # triton.runtime.jit.JITFunction (3.6, 3.8)
    if compile_ is None or not callable(compile_):
        return  # the interpreter, or a Triton without this hook: nothing is compiled here

    def compile_unless_capturing(*args, **kwargs):
        if capturing():
            name = getattr(getattr(kernel, "fn", None), "__name__", "kernel")
            raise CaptureCompileError(
                f"{path}: {name} would be JIT-compiled for a new Triton specialisation while a CUDA "
                "graph is being captured. Run the fused module once at this shape before capturing "
                "it (sglang's two warm-ups per batch size do), or apply fuser with example inputs "
                "whose strides and alignment match the captured ones."
            )
        return compile_(*args, **kwargs)

    kernel._do_compile = compile_unless_capturing
