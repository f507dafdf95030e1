"""The ``fuser`` command: explain and check a module given as ``FILE.py:FACTORY``.

FACTORY is any function in FILE.py that returns ``(module, example_inputs)``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path


def load_factory(spec: str):
    """``path/to/file.py:factory`` -> the factory function."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise SystemExit(f"fuser: expected FILE.py:FACTORY, got {spec!r}")
    file = Path(path).resolve()
    if not file.exists():
        raise SystemExit(f"fuser: {path}: no such file")
    sys.path.insert(0, str(Path.cwd()))
    module_spec = importlib.util.spec_from_file_location(f"_fuser_factory_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"fuser: {path} has no function {name!r}")
    return factory


def _use_interpreter_without_gpu():
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's CPU interpreter


def _options(args) -> dict:
    return {"leaves": args.leaf or (), "patterns": args.patterns or ()}


def cmd_explain(args) -> int:
    import fuser

    module, inputs = load_factory(args.target)()
    report = fuser.explain(module, inputs, **_options(args))
    print(report.json() if args.json else report.text())
    return 0


def cmd_check(args) -> int:
    import fuser

    module, inputs = load_factory(args.target)()
    result = fuser.check(module, inputs, **_options(args))
    if args.json:
        print(json.dumps({"ok": result.ok, "problems": result.problems, "compared": result.compared}, indent=2))
    else:
        print(result.text())
    return 0 if result.ok else 1


def cmd_profile(args) -> int:
    from fuser.profile import profile

    module, inputs = load_factory(args.target)()
    chains = profile(module, inputs, **_options(args)).chains
    where = "eager CUDA time" if any(c.gpu_us is not None for c in chains) else "eager kernel launches"
    print(f"glue chains of {type(module).__name__}, costliest first ({where}):")
    for chain in chains:
        print("  " + chain.describe())
    return 0


def cmd_suggest(args) -> int:
    from fuser.profile import profile, skeleton, suggestion_target

    module, inputs = load_factory(args.target)()
    result = profile(module, inputs, **_options(args))
    target = suggestion_target(result.chains)
    if target is None:
        print("fuser: every glue chain is already claimed by a pattern", file=sys.stderr)
        return 1
    source = skeleton(target, result.traced, result.cops, Path(args.out).stem if args.out else "new_chain")
    if args.out:
        Path(args.out).write_text(source)
        print(f"wrote {args.out} for: {target.describe()}")
    else:
        print(source)
    return 0


def cmd_bench(args) -> int:
    from fuser import bench

    tokens = tuple(int(t) for t in args.tokens.split(","))
    variants = tuple(args.variants.split(","))
    result = bench.run(load_factory(args.target), args.target, tokens, variants)
    paths = bench.write(result, Path(args.out), args.name)
    print(result.markdown())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fuser", description=__doc__.strip().splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (
        ("explain", cmd_explain, "what fuser fuses in the module, what it rejects and why"),
        ("check", cmd_check, "run fused vs eager on the factory's inputs; exit 1 on mismatch"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("target", metavar="FILE.py:FACTORY")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--leaf", action="append", help="a submodule name to keep opaque (repeatable)")
        p.add_argument("--patterns", action="append", help="an extra pattern file or directory (repeatable)")
        p.set_defaults(fn=fn)
    p = sub.add_parser("profile", help="rank the glue chains by cost, with what fuser does to each")
    p.add_argument("target", metavar="FILE.py:FACTORY")
    p.add_argument("--leaf", action="append")
    p.add_argument("--patterns", action="append")
    p.set_defaults(fn=cmd_profile)
    p = sub.add_parser("suggest", help="draft a pattern file for the costliest chain no pattern claims")
    p.add_argument("target", metavar="FILE.py:FACTORY")
    p.add_argument("-o", "--out", help="write the pattern file here (default: print it)")
    p.add_argument("--leaf", action="append")
    p.add_argument("--patterns", action="append")
    p.set_defaults(fn=cmd_suggest)
    p = sub.add_parser("bench", help="eager vs torch.compile vs fuser on the GPU, each replayed in a CUDA graph")
    p.add_argument("target", metavar="FILE.py:FACTORY", help="FACTORY(T=..., device='cuda') -> (module, inputs)")
    p.add_argument("--tokens", default="1,8,32,128,512", help="token counts (comma-separated)")
    p.add_argument("--variants", default="eager,compile,fuser")
    p.add_argument("--out", default="benchmarks/results", help="directory for the .json and .md results")
    p.add_argument("--name", default="bench", help="file name stem of the results")
    p.set_defaults(fn=cmd_bench)
    args = parser.parse_args(argv)
    _use_interpreter_without_gpu()
    from fuser.api import FuserError
    from fuser.emit import TemplateError
    from fuser.pattern import PatternError
    from fuser.trace import TraceRefused

    try:
        return args.fn(args)
    except (FuserError, PatternError, TemplateError, TraceRefused) as e:
        print(f"fuser: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
