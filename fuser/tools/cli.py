"""The ``fuser`` command: explain, check, profile and bench a module given as ``FILE.py:FACTORY``.

FACTORY is any function in FILE.py that returns ``(module, example_inputs)``.

Exit codes: 0 ok, 1 a mismatch (``check``, ``test-pattern``; for ``check`` also a candidate
kernel that could not run at all, so was never compared), 2 a usage or input error (a missing
file or factory, a factory that raises or exits, a bad pattern file, a module fuser refuses,
triton imported without its interpreter on a machine without CUDA), 3 an internal error of
fuser. Errors are one line on stderr; ``FUSER_DEBUG=1`` prints their traceback first.

With ``--json`` (every command has it) stdout holds the JSON alone: whatever the factory, the
module or fuser print goes to stderr.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import sysconfig
import traceback
from pathlib import Path

from fuser import __version__, interpreter_problem
from fuser.api import kernels_that_could_not_run
from fuser.pipeline.options import library_options
from fuser.trace.leaves import UnknownLeaf
from fuser.trace.leaves import resolve_leaves as _resolve_leaves

OK, MISMATCH, USAGE, INTERNAL = 0, 1, 2, 3

_FUSER_DIR = Path(__file__).resolve().parent.parent  # the fuser package


class UsageError(Exception):
    """A mistake in the command line or in what it names: exit 2, one line on stderr."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _what_it_did(error: BaseException) -> str:
    """``raised ValueError: ...``, or ``called sys.exit(7)`` for a SystemExit."""
    return f"called sys.exit({error.code!r})" if isinstance(error, SystemExit) else f"raised {_first_line(error)}"


def _frame_in(error: BaseException, file: Path) -> str:
    """``file:line`` of the innermost traceback frame in ``file``, or ``file``."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == file]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else str(file)


def load_factory(spec: str):
    """``path/to/file.py:factory`` -> the factory function (UsageError if there is none)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise UsageError(f"expected FILE.py:FACTORY, got {spec!r}")
    file = Path(path).resolve()
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    sys.path.insert(0, str(Path.cwd()))
    module_spec = importlib.util.spec_from_file_location(f"_fuser_factory_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure to import the user's file is the input's
        raise UsageError(f"{_frame_in(e, file)}: cannot load {path}: it {_what_it_did(e)}") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(f"{path} has no function {name!r}")
    return factory


def build(spec: str, **factory_args):
    """Call the factory of ``FILE.py:FACTORY``: ``(module, args, kwargs)`` (a factory returns
    ``(module, example_inputs)`` or ``(module, args, kwargs)``)."""
    import torch

    from fuser.trace.call_spec import example_call

    factory = load_factory(spec)
    file = Path(spec.rpartition(":")[0]).resolve()
    try:
        result = factory(**factory_args)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's factory failed, not fuser
        raise UsageError(f"{_frame_in(e, file)}: {factory.__name__}() {_what_it_did(e)}") from e
    try:
        module, args, kwargs = example_call(result)
    except TypeError as e:
        raise UsageError(f"{spec}: {e}") from None
    if not isinstance(module, torch.nn.Module):
        line = getattr(getattr(factory, "__code__", None), "co_firstlineno", None)
        what = " ".join(filter(None, [type(module).__name__, getattr(module, "__name__", None)]))
        raise UsageError(
            f"{file}{f':{line}' if line else ''}: {factory.__name__}() returned {what} as the module;"
            " fuser fuses a torch.nn.Module: return one whose forward calls it"
        )
    return module, args, kwargs


def resolve_leaves(module, names) -> list:
    """``--leaf`` names -> trace leaves, read as ``fuser.apply(leaves=...)`` reads them
    (:func:`fuser.trace.leaves.resolve_leaves`); a name that names nothing is a usage error."""
    try:
        return _resolve_leaves(module, names)
    except UnknownLeaf as e:
        raise UsageError(f"--leaf {e.name!r} {e.detail}") from None


def pattern_paths(paths) -> list[Path]:
    """``--patterns`` entries -> pattern files: a file as given; a directory as the ``*.py`` in it
    that assign ``PATTERN`` at their top level, read, not run, so that a helper module beside
    them is neither executed nor refused (files named ``_*`` are skipped, as the loader does)."""
    found = []
    for entry in map(Path, paths or ()):
        if not entry.is_dir():
            found.append(entry)  # a missing one: the loader names it
            continue
        files = [f for f in sorted(entry.glob("*.py")) if not f.name.startswith("_") and _declares_pattern(f)]
        if not files:
            raise UsageError(f"--patterns {entry}: no pattern file there (a pattern file assigns PATTERN = dict(...))")
        found += files
    return found


def _declares_pattern(file: Path) -> bool:
    try:
        tree = ast.parse(file.read_text(), filename=str(file))
    except SyntaxError:
        return True  # the loader reports it, with its line
    targets = [t for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]  # fmt: skip
    return any(isinstance(t, ast.Name) and t.id == "PATTERN" for t in targets)


def _options(args, module, kwargs) -> dict:
    """The options of every command on a module: ``--leaf`` and ``--patterns``, then
    ``FUSER_LEAVES`` and ``FUSER_PRECOMPUTE`` read as the library reads them (``profile`` and
    ``suggest`` plan without ``fuser.apply``)."""
    options = {"leaves": resolve_leaves(module, args.leaf), "patterns": pattern_paths(args.patterns), "example_kwargs": kwargs}
    if getattr(args, "batch_input", None):
        options["batch_inputs"] = batch_inputs(args.batch_input)
    return library_options(module, options)


def batch_inputs(entries) -> dict[str, int]:
    """``--batch-input NAME=DIM`` entries -> ``batch_inputs`` (:mod:`fuser.trace.token_dims`):
    each names a forward parameter (for all its tensors) or one graph input, and the dim of it
    that follows the tokens; the inputs not named are held at their sizes."""
    found = {}
    for entry in entries:
        name, sep, dim = entry.partition("=")
        try:
            found[name.strip()] = int(dim)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise UsageError(f"--batch-input {entry!r}: give NAME=DIM, the input and the dim of it that follows the tokens (hidden_states=0)")
    return found


def _say(args, text: str) -> None:
    """The command's result, on the real stdout (with ``--json``, anything else printed while
    the command runs goes to stderr)."""
    print(text, file=getattr(args, "stdout", None) or sys.stdout)


def _could_not_run(failed: list[str], shown: int = 5) -> list[str]:
    lines = [
        f"{len(failed)} candidate kernel{'s' if len(failed) != 1 else ''} could not run at validation"
        " (an error of the environment or of fuser, not a difference from eager), so they were not compared:"
    ]
    lines += [f"  {f}" for f in failed[:shown]]
    if len(failed) > shown:
        lines.append(f"  ... and {len(failed) - shown} more (`fuser explain` lists them all)")
    return lines


def cmd_explain(args) -> int:
    import fuser

    module, inputs, kwargs = build(args.target)
    report = fuser.explain(module, inputs, **_options(args, module, kwargs))
    _say(args, report.json() if args.json else report.text())
    failed = kernels_that_could_not_run(report)
    if failed:
        print("\n".join(f"fuser: note: {line}" for line in _could_not_run(failed)), file=sys.stderr)
    return OK


def cmd_check(args) -> int:
    import fuser

    module, inputs, kwargs = build(args.target)
    result = fuser.check(module, inputs, **_options(args, module, kwargs))
    failed, kernels, ok = result.not_run, result.kernels, result.ok
    if args.json:
        report = result.report.to_json() if result.report is not None else None
        _say(args, json.dumps({
            "ok": ok, "problems": result.problems, "compared": result.compared, "kernels": kernels,
            "kernels_not_run": failed, "report": report,
        }, indent=2, default=str))  # fmt: skip
        return OK if ok else MISMATCH
    head = "check passed" if ok else "check FAILED"
    lines = [
        f"{head}: fused vs eager on the example inputs ({len(result.compared)} tensors compared,"
        f" {kernels} fused kernel{'s' if kernels != 1 else ''} ran)"
    ]
    lines += [f"  {p}" for p in result.problems]
    if failed:
        lines += ["  " + line for line in _could_not_run(failed)]
    _say(args, "\n".join(lines))
    return OK if ok else MISMATCH


def cmd_profile(args) -> int:
    from fuser.tools.profile import profile

    module, inputs, kwargs = build(args.target)
    chains = profile(module, inputs, **_options(args, module, kwargs)).chains
    on_gpu = any(c.gpu_us is not None for c in chains)
    if args.json:
        cost = "gpu_us" if on_gpu else "launches"
        _say(args, json.dumps({"module": type(module).__name__, "cost": cost, "chains": [c.to_json() for c in chains]}, indent=2))
        return OK
    where = "eager CUDA time" if on_gpu else "eager kernel launches"
    _say(args, f"glue chains of {type(module).__name__}, costliest first ({where}):")
    for chain in chains:
        _say(args, "  " + chain.describe())
    return OK


def cmd_suggest(args) -> int:
    from fuser.tools.profile import profile, skeleton, suggestion_target

    if args.out and Path(args.out).exists() and not args.force:
        raise UsageError(f"{args.out} exists; pass --force to overwrite it")
    module, inputs, kwargs = build(args.target)
    result = profile(module, inputs, **_options(args, module, kwargs))
    target = suggestion_target(result)
    if target is None:
        message = "nothing to suggest: every glue chain is claimed by a pattern"
        _say(args, json.dumps({"chain": None, "file": None, "source": None}) if args.json else f"fuser: {message}")
        return OK
    source = skeleton(target, result.traced, result.cops, Path(args.out).stem if args.out else "new_chain")
    if args.out:
        Path(args.out).write_text(source)
    if args.json:
        _say(args, json.dumps({"chain": target.to_json(), "file": args.out, "source": source}, indent=2))
    elif args.out:
        _say(args, f"wrote {args.out} for: {target.describe()}")
    else:
        _say(args, source)
    return OK


def cmd_bench(args) -> int:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("bench needs a CUDA GPU and there is none here (`fuser profile` ranks the chains on the CPU)")
    from fuser.tools import bench

    tokens = tuple(int(t) for t in args.tokens.split(","))
    variants = tuple(args.variants.split(","))
    result = bench.run(load_factory(args.target), args.target, tokens, variants)
    paths = bench.write(result, Path(args.out), args.name)
    if args.json:
        _say(args, json.dumps({**json.loads(result.json()), "files": [str(p) for p in paths]}, indent=2))
        return OK
    _say(args, result.markdown())
    _say(args, "wrote " + ", ".join(str(p) for p in paths))
    return OK


TUNE_TOKENS = "8,256"


def cmd_tune(args) -> int:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("tune times kernels on a CUDA GPU and there is none here")
    if args.lone_ops:
        return _tune_lone_ops(args)
    if args.decode_gemm:
        return _tune_decode_gemm(args)
    if not args.target:
        raise UsageError("tune needs FILE.py:FACTORY (or --lone-ops or --decode-gemm, which time ops alone and need none)")
    from fuser.tools import bench
    from fuser.codegen.launch_config import TABLE_DIR, current_gpu
    from fuser.tools.tune import tune, write_table

    tokens = tuple(int(t) for t in (args.tokens or TUNE_TOKENS).split(","))
    module, inputs, kwargs = build(args.target, T=max(tokens), device="cuda")
    entries = tune(module, inputs, kwargs, tokens)
    about = {**bench.stamp(), "tokens": list(tokens)}
    path = write_table(entries, Path(args.out) if args.out else TABLE_DIR, current_gpu(), about)
    slow = [e for e in entries if e["heuristic_over_best"] > 1.1]
    if args.json:
        _say(args, json.dumps({"table": str(path), "gpu": current_gpu(), **about, "entries": entries}, indent=2, default=str))
        return OK
    _say(args, f"wrote {path}: {len(entries)} kernels; the heuristic is within 10% of the best on {len(entries) - len(slow)}")
    if args.out:
        _say(args, f"fuser reads it with FUSER_LAUNCH_CONFIGS={Path(args.out).resolve()}")
    return OK


def _tune_decode_gemm(args) -> int:
    """``fuser tune --decode-gemm``: the decode-GEMM table of this GPU (fuser.tools.tune_decode_gemm)."""
    if args.target:
        raise UsageError("tune --decode-gemm times GEMMs alone; it takes no FILE.py:FACTORY")
    from fuser.tools import bench
    from fuser.codegen.launch_config import TABLE_DIR, current_gpu
    from fuser.tools import tune_decode_gemm as gemm

    try:
        shapes = gemm.shapes_of(args.shapes) if args.shapes else gemm.STANDARD_SHAPES
        dtypes = tuple(t.strip() for t in args.dtypes.split(",") if t.strip()) if args.dtypes else ("bfloat16",)
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else gemm.DECODE_TOKENS
        entries = gemm.measure_all(shapes, dtypes, tokens, log=lambda line: _say(args, line) if not args.json else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    about = {**bench.stamp(), "tokens": list(tokens)}
    path = gemm.write_table(entries, Path(args.out) if args.out else TABLE_DIR, current_gpu(), about)
    if args.json:
        _say(args, json.dumps({"table": str(path), "gpu": current_gpu(), **about, "entries": entries}, indent=2, default=str))
        return OK
    taken = sum(e["up_to"] > 0 for e in entries)
    _say(args, f"wrote {path}: {len(entries)} GEMM shapes, {taken} faster on fuser's kernel at one token or more")
    if args.out:
        _say(args, f"fuser reads it with FUSER_LAUNCH_CONFIGS={Path(args.out).resolve()}")
    return OK


def _tune_lone_ops(args) -> int:
    """``fuser tune --lone-ops``: the lone-op table of this GPU (fuser.tools.tune_lone_ops)."""
    if args.target:
        raise UsageError("tune --lone-ops times ops alone; it takes no FILE.py:FACTORY")
    from fuser.tools import bench
    from fuser.codegen.launch_config import TABLE_DIR, current_gpu
    from fuser.tools import tune_lone_ops as lone

    def numbers(text, default):
        return tuple(int(t) for t in text.split(",")) if text else default

    def names(text):
        return tuple(t.strip() for t in text.split(",") if t.strip()) if text else None

    tokens = numbers(args.tokens, lone.DECODE_TOKENS)
    try:
        entries = lone.measure_all(names(args.ops), numbers(args.widths, lone.STANDARD_WIDTHS), names(args.dtypes), tokens,
                                   log=lambda line: _say(args, line) if not args.json else None)  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None
    about = {**bench.stamp(), "tokens": list(tokens)}
    path = lone.write_table(entries, Path(args.out) if args.out else TABLE_DIR, current_gpu(), about)
    if args.json:
        _say(args, json.dumps({"table": str(path), "gpu": current_gpu(), **about, "entries": entries}, indent=2, default=str))
        return OK
    fused = sum(e["fused"] for e in entries)
    _say(args, f"wrote {path}: {len(entries)} ops alone, {fused} faster as fuser's kernel than PyTorch's")
    if args.out:
        _say(args, f"fuser reads it with FUSER_LAUNCH_CONFIGS={Path(args.out).resolve()}")
    return OK


def cmd_test_pattern(args) -> int:
    from fuser.testing import run_pattern_file

    path = Path(args.file)
    if path.is_dir():
        files = ", ".join(f.name for f in sorted(path.glob("*.py")) if _declares_pattern(f)) or "none"
        raise UsageError(f"{args.file} is a directory; test-pattern takes one pattern file (pattern files there: {files})")
    if not path.is_file():
        raise UsageError(f"{args.file}: no such file")
    return run_pattern_file(args.file, out=getattr(args, "stdout", None), err=sys.stderr, as_json=args.json)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="fuser",
        description=__doc__.strip().splitlines()[0].replace("``", ""),
        epilog="exit codes: 0 ok, 1 mismatch, 2 usage or input error, 3 internal error (FUSER_DEBUG=1: traceback)",
    )
    top.add_argument("--version", action="version", version=f"fuser {__version__}", help="print fuser's version and exit")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    def module_options(p: argparse.ArgumentParser, json_help: str = "machine-readable output (JSON)") -> None:
        p.add_argument(
            "target", metavar="FILE.py:FACTORY", help="a function in FILE.py returning (module, args) or (module, args, kwargs)"
        )
        p.add_argument("--json", action="store_true", help=json_help)
        p.add_argument(
            "--leaf", action="append", metavar="NAME",
            help="keep this opaque: a submodule name, a module class name or package.module.function (repeatable)",
        )  # fmt: skip
        p.add_argument("--patterns", action="append", metavar="PATH", help="an extra pattern file or directory (repeatable)")
        p.add_argument(
            "--batch-input", action="append", metavar="NAME=DIM",
            help="this input follows the tokens along DIM (repeatable; by default read off the example: "
                 "dim 0 of the hidden states' size or a multiple of it); the inputs not named are held at their sizes",
        )  # fmt: skip

    module_options(command("explain", cmd_explain, "what fuser fuses in the module, what it rejects and why"))
    module_options(command("check", cmd_check, "run fused vs eager on the factory's inputs; exit 1 on mismatch"))
    module_options(command("profile", cmd_profile, "rank the glue chains by cost, with what fuser does to each"))
    p = command("suggest", cmd_suggest, "draft a pattern file for the costliest glue no pattern claims")
    module_options(p, "print the chain, the file written and the draft as JSON")
    p.add_argument("-o", "--out", metavar="FILE.py", help="write the pattern file here (default: print it)")
    p.add_argument("--force", action="store_true", help="overwrite the --out file if it exists")
    p = command("bench", cmd_bench, "eager vs torch.compile vs fuser on the GPU, each replayed in a CUDA graph")
    p.add_argument("target", metavar="FILE.py:FACTORY", help="FACTORY(T=..., device='cuda') -> (module, inputs)")
    p.add_argument("--tokens", default="1,8,32,128,512", help="token counts, comma-separated (default: %(default)s)")
    p.add_argument("--variants", default="eager,compile,fuser", help="what to time, comma-separated (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the .json and .md results (default: %(default)s)")
    p.add_argument("--name", default="bench", help="file name stem of the results (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the results as JSON (the files are written as well)")
    p = command("tune", cmd_tune, "choose each fused kernel's warps on this GPU, offline; writes a launch table")
    p.add_argument("target", metavar="FILE.py:FACTORY", nargs="?", help="FACTORY(T=..., device='cuda') -> (module, inputs)")
    p.add_argument("--tokens", help=f"token counts to time at, comma-separated (default: {TUNE_TOKENS}; with --lone-ops 1,2,4,8,16)")
    p.add_argument("--lone-ops", action="store_true", help="time ops alone (LayerNorm, GELU, softmax, ...) against PyTorch's "
                   "and write <GPU>-lone_ops.json, which decides whether a lone op gets a kernel of its own")
    p.add_argument("--decode-gemm", action="store_true", help="time fuser's decode GEMM kernel against PyTorch's GEMM per "
                   "weight shape and write <GPU>-decode_gemm.json, which decides where linear layers run on it")
    p.add_argument("--shapes", help="with --decode-gemm: weight shapes NxK, comma-separated (default: Llama-3.2-1B's and Qwen3-8B's)")
    p.add_argument("--ops", help="with --lone-ops: op kinds, comma-separated (default: the standard set)")
    p.add_argument("--widths", help="with --lone-ops: row widths, comma-separated (default: 64 to 8192)")
    p.add_argument("--dtypes", help="with --lone-ops or --decode-gemm: dtypes, comma-separated (default: each op's; bfloat16)")
    p.add_argument("--out", metavar="DIR", help="directory of the table (default: fuser's own launch_configs/)")
    p.add_argument("--json", action="store_true", help="print the table written and its entries as JSON")
    p = command("test-pattern", cmd_test_pattern, "golden-test a pattern file on its own; exit 1 on mismatch, 2 if invalid")
    p.add_argument("file", metavar="FILE.py", help="the pattern file")
    p.add_argument("--json", action="store_true", help="print each case and the totals as JSON")
    return top


def _user_frame_of(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``error`` in the user's own code (a module's
    forward that fuser was tracing, say): neither fuser, torch, an installed package nor the
    standard library. None if the error comes from fuser alone."""
    import torch

    library = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    library = tuple(str(Path(p).resolve()) for p in library | {Path(torch.__file__).parent, _FUSER_DIR} if p)
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not str(Path(frame.filename).resolve()).startswith(library):
            return f"{frame.filename}:{frame.lineno}"
    return None


def run(args) -> int:
    """Run the command; errors as one line on stderr (after their traceback with
    ``FUSER_DEBUG=1``) and their exit code. With ``--json``, what the factory, the module or
    fuser print while it runs goes to stderr, so that stdout holds the JSON alone."""
    from fuser.pipeline.fuse_module import FuserError
    from fuser.codegen.emit import TemplateError
    from fuser.pattern import PatternError
    from fuser.trace.tracing import TraceRefused

    debug = os.environ.get("FUSER_DEBUG") == "1"
    args.stdout = sys.stdout
    try:
        problem = interpreter_problem()
        if problem:
            raise UsageError(problem)
        with contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else contextlib.nullcontext():
            return args.fn(args)
    except BrokenPipeError:
        raise
    except (UsageError, FuserError, PatternError, TemplateError, TraceRefused) as e:
        if debug:
            traceback.print_exc()
        print(f"fuser: {e}", file=sys.stderr)
        return USAGE
    except (Exception, SystemExit) as e:  # noqa: BLE001 - anything else: one line, the traceback on request
        if debug:
            traceback.print_exc()
        where = _user_frame_of(e)
        if where:  # raised in the user's code (the module's forward, say)
            print(f"fuser: {where}: {_what_it_did(e) if isinstance(e, SystemExit) else _first_line(e)}", file=sys.stderr)
            return USAGE
        hint = "" if debug else " (run with FUSER_DEBUG=1 for the traceback)"
        print(f"fuser: internal error: {_first_line(e)}{hint}", file=sys.stderr)
        return INTERNAL


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        code = run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`fuser explain ... | head`): stop quietly. Python would flush
        # stdout again at exit and fail on it, so point it at devnull first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK


if __name__ == "__main__":
    sys.exit(main())
