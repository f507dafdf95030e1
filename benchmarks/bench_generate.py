"""``model.generate()`` as users run it: tokens/s of transformers CausalLMs at real dims (random
weights, a few layers where memory needs it), bf16 on the GPU, greedy, a 32-token prompt and
128 new tokens, at batch 1 and 8:

* ``eager`` — ``generate`` with its default dynamic cache, and ``eager static`` — a static cache,
  no compile (``disable_compile=True``);
* ``compile`` — transformers' documented static-cache recipe: ``cache_implementation="static"``,
  with which ``generate`` compiles the forward itself (its default ``CompileConfig``:
  ``mode="reduce-overhead"``: CUDA graphs);
* ``fuser`` — ``fuser.apply(model)`` (fused at the first decode call), dynamic cache; and
  ``fuser static`` with a static cache;
* ``fuser graphs`` — ``fuser.apply(model, cuda_graphs=True)``, static cache: decode steps
  replayed from CUDA graphs.

    PYTHONPATH=. python benchmarks/bench_generate.py [--models llama_1b,qwen3_8b] [--batches 1,8]

``ready_s`` is the wall time of the first ``generate`` of a variant (4 new tokens), which
includes apply (tracing, kernels, validation) and capture, or compile; ``tokens_per_s`` is
new tokens (batch x 128) over the wall time of a later ``generate``, the better of two. Every
variant runs the same weights; a variant's tokens are compared with eager static's (greedy
tokens can part at a near tie of bf16 logits, so the count of equal tokens is reported, not
asserted). Writes benchmarks/results/generate.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fuser  # noqa: E402
from benchmarks import causal_lms  # noqa: E402
from benchmarks.causal_lms import MODELS  # noqa: E402

OUT = ROOT / "benchmarks/results"
PROMPT, NEW = 32, 128
VARIANTS = ("eager", "eager static", "compile", "fuser", "fuser static", "fuser graphs")


def causal_lm(name: str):
    lm = causal_lms.causal_lm(name)
    lm.generation_config.eos_token_id = None  # random weights: every run makes all NEW tokens
    lm.generation_config.pad_token_id = 0
    return lm


def generate(model, ids, new: int, static: bool):
    kwargs = dict(cache_implementation="static") if static else {}
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, **kwargs)  # fmt: skip


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def run_variant(model, variant: str, ids, reference) -> dict:
    static = variant in ("eager static", "compile", "fuser static", "fuser graphs")
    setup, setting = 0.0, model.generation_config.disable_compile
    if variant == "compile":
        torch._dynamo.reset()  # its compile is part of its first generate
        vars(model).pop("_compiled_call", None)
    elif variant.startswith("fuser"):
        started = time.perf_counter()
        fuser.apply(model, cuda_graphs=variant == "fuser graphs")
        setup = time.perf_counter() - started
    if variant in ("eager static",):
        model.generation_config.disable_compile = True
    try:
        ready, _ = timed(lambda: generate(model, ids, 4, static))
        runs = [timed(lambda: generate(model, ids, NEW, static)) for _ in range(2)]
        wall, out = min(runs, key=lambda r: r[0])
        stats = fuser.stats(model) if variant.startswith("fuser") else {}
    finally:
        if variant == "compile":
            torch._dynamo.reset()
            vars(model).pop("_compiled_call", None)
        elif variant.startswith("fuser"):
            fuser.restore(model)
        model.generation_config.disable_compile = setting
    new = out[:, ids.shape[1]:]
    row = dict(tokens=new, variant=variant, batch=ids.shape[0], ready_s=round(setup + ready, 2), wall_s=round(wall, 3),
               tokens_per_s=round(new.numel() / wall, 1))  # fmt: skip
    if reference is not None:
        row["same_tokens"] = f"{int((new == reference).sum())}/{new.numel()}"
    if stats:
        layers = {k: v for k, v in stats.items() if ".layers." in k}
        row["layer_calls_fused"] = sum(v["fused"] for v in layers.values())
        row["layer_calls_declined"] = {r: n for v in layers.values() for r, n in v["declined"].items()}
    graphed = getattr(model, "_fuser_graphed", None)
    if graphed is not None:
        row["replays"] = graphed.replays
        row["not_captured"] = dict(graphed.not_captured)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        model = causal_lm(name)
        for batch in map(int, args.batches.split(",")):
            ids = torch.randint(1, model.config.vocab_size, (batch, PROMPT), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(1))  # fmt: skip
            reference = None
            for variant in args.variants.split(","):
                try:
                    row = run_variant(model, variant, ids, reference)
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                    row = dict(variant=variant, batch=batch, failed=f"{type(e).__name__}: {str(e)[:300]}")
                row["model"] = name
                tokens = row.pop("tokens", None)
                if variant == "eager static" and tokens is not None:
                    reference = tokens
                print(json.dumps(row), flush=True)
                rows.append(row)
                write(Path(args.out), rows)
        del model
        torch.cuda.empty_cache()
    print(table(rows))


def write(out: Path, rows: list[dict]) -> None:
    """The results so far (after every row: a run cut short keeps what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                       rows=rows), indent=2))  # fmt: skip
    (out / "generate.md").write_text(table(rows))


def declines(by_reason: dict[str, int]) -> str:
    """Layer calls declined: the total, and the commonest reasons (a size that differs from the
    traced one counted as one reason, whatever its value)."""
    grouped: dict[str, int] = {}
    for reason, n in by_reason.items():
        key = reason.split(" is ")[0] + " differs" if " traced with " in reason and " dim " in reason else reason[:60]
        grouped[key] = grouped.get(key, 0) + n
    top = sorted(grouped.items(), key=lambda x: -x[1])[:3]
    return f"{sum(by_reason.values())} layer calls declined: " + "; ".join(f"{k} ({n})" for k, n in top)


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | variant | tokens/s | × eager | ready s | same tokens | note |", "|---|---|---|---|---|---|---|---|"]
    eager = {(r["model"], r["batch"]): r.get("tokens_per_s") for r in rows if r["variant"] == "eager"}
    for r in rows:
        base = eager.get((r["model"], r["batch"]))
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base and r.get("tokens_per_s") else ""
        note = r.get("failed") or (f"{r['replays']} replays" if r.get("replays") else "")
        if r.get("layer_calls_declined"):
            note += " " + declines(r["layer_calls_declined"])
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {r.get('tokens_per_s', '')} | {ratio} | "
                     f"{r.get('ready_s', '')} | {r.get('same_tokens', '')} | {note} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:  # the markdown again from the json
        (OUT / "generate.md").write_text(table(json.loads((OUT / "generate.json").read_text())["rows"]))
    else:
        main()
