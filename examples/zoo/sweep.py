"""``fuser.check`` on every decoder layer transformers ships that the zoo does not hold, at tiny
dims on the CPU: one line a layer (its glue launches eager -> fused, what stays eager, any
mismatch or error), then a count of each outcome.

    TRITON_INTERPRET=1 PYTHONPATH=. python examples/zoo/sweep.py [MODEL ...] [--timeout S]

A layer is guessed from its modeling file (``<Prefix>DecoderLayer``, else ``<Prefix>Block`` where a
``<Prefix>Config`` goes with it: GPT-2's family; a MoE when the file speaks
of experts, ``<Prefix>RotaryEmbedding`` where it has one) and built as ``examples/zoo/layers.py``
builds the zoo's; a layer that cannot be built or called that way (encoder-decoder layers,
multimodal configs, layers that take more inputs) is counted as skipped with the reason, not
as a failure of fuser. Nothing is edited to suit fuser.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fuser  # noqa: E402
from examples.zoo import layers as zoo  # noqa: E402


def models_of_transformers() -> list[str]:
    import transformers

    root = Path(transformers.__file__).parent / "models"
    return sorted(d.name for d in root.iterdir() if (d / f"modeling_{d.name}.py").is_file())


def spec_of(model: str) -> dict | None:
    """The zoo's spec of ``model`` read off its modeling file, or None without a decoder layer."""
    import transformers

    folder = Path(transformers.__file__).parent / "models" / model
    source = (folder / f"modeling_{model}.py").read_text()
    layer = "DecoderLayer"
    found = re.findall(r"^class (\w+)DecoderLayer\(", source, re.M)
    if not found:  # GPT-2's family names its layer a block: GPT2Block, CodeGenBlock, GPTBigCodeBlock
        configs = (folder / f"configuration_{model}.py")
        configs = configs.read_text() if configs.is_file() else ""
        found = [p for p in re.findall(r"^class (\w+)Block\(", source, re.M) if f"class {p}Config(" in configs]
        layer = "Block"
    if not found:
        return None
    prefix = found[0]
    moe = "num_experts" in source or "num_local_experts" in source
    spec = dict(module=model, prefix=prefix, tiny=zoo._MOE if moe else zoo._DENSE)
    if layer != "DecoderLayer":
        spec["layer"] = prefix + layer
    if f"class {prefix}RotaryEmbedding" not in source:
        spec["rotary"] = None
    return spec


class _TimedOut(Exception):
    pass


def _timed_out(*_):
    raise _TimedOut()


def sweep_one(model: str, timeout: int) -> tuple[str, str]:
    """(outcome, line): ok, mismatch, error, timeout or skipped."""
    spec = spec_of(model)
    if spec is None:
        return "skipped", f"{model}: skipped (no decoder layer)"
    zoo.UNSEEN.setdefault(model, spec)
    signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(timeout)
    try:
        try:
            layer, args, kwargs = zoo.build(model, T=3)
            with torch.no_grad():
                layer(*args, **kwargs)
        except _TimedOut:
            raise
        except Exception as e:  # not buildable the zoo's way: not fuser's failure
            return "skipped", f"{model}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        result = fuser.check(layer, args, example_kwargs=kwargs)
        report = result.report
        left = sorted({u.op for u in report.unfused})
        line = f"{model}: {report.launches_before} -> {report.launches_after} glue launches; eager: {left or 'none'}"
        if result.ok:
            return "ok", line
        return "mismatch", f"{line}; MISMATCH {result.problems[:2]} {result.not_run[:2]}"
    except _TimedOut:
        return "timeout", f"{model}: timed out after {timeout} s"
    except Exception as e:
        return "error", f"{model}: ERROR {type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.alarm(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="transformers model folders (default: every one the zoo lacks)")
    parser.add_argument("--timeout", type=int, default=180, help="seconds a layer")
    args = parser.parse_args()
    known = set(zoo.MODELS) | set(zoo.UNSEEN)
    models = args.models or [m for m in models_of_transformers() if m not in known]
    outcomes = Counter()
    for model in models:
        outcome, line = sweep_one(model, args.timeout)
        outcomes[outcome] += 1
        print(line, flush=True)
    print(", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())))
    return 1 if outcomes["mismatch"] or outcomes["error"] or outcomes["timeout"] else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
