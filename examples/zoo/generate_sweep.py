"""What ``model.generate()`` does after ``fuser.apply(model)`` on each transformers CausalLM the zoo
builds (``examples/zoo/layers.py``: its models and the ``UNSEEN`` ones): two decoder layers at
tiny dims, fp32 (greedy tokens compare exactly; ``--dtype bfloat16`` as models are served),
generate's own dynamic cache (``--cache static``: a static one), batch 2 with left padding, as
a user would call it with no example. One line a model: whether its tokens are
eager's, how many decode steps each layer ran fused (a generate of NEW tokens makes NEW - 1),
the calls declined other than the prefill, and any warning fuser gave.

    TRITON_INTERPRET=1 PYTHONPATH=. python examples/zoo/generate_sweep.py [MODEL ...] [--dtype bfloat16] [--cache static] [--out FILE]

A model transformers cannot build or generate with at these dims is listed with the reason,
not counted as fuser's failure.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fuser  # noqa: E402
from examples.zoo import layers as zoo  # noqa: E402

BATCH, PROMPT, NEW = 2, 21, 4  # (key lengths 22-25: clear of the tiny dims, 16 and 32, a mask held next to one re-fuses)


def prompt():
    """Token ids and their attention mask, the first sequence left-padded by two."""
    ids = torch.randint(1, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def generate(model, ids, mask, cache: str = "dynamic"):
    """Greedy; a static cache without transformers' own compile of its step."""
    kwargs = dict(cache_implementation="static", disable_compile=True) if cache == "static" else {}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              **kwargs)  # fmt: skip


def layer_calls(model, report) -> dict[str, dict]:
    """fuser.stats of the model's fused decoder layers."""
    layers = {name for group in report.groups if group.report is not None for name in group.layers}
    return {name: counts for name, counts in fuser.stats(model).items() if name in layers}


def swept(name: str, dtype: torch.dtype = torch.float32, cache: str = "dynamic") -> str:
    """The model's line."""
    try:
        try:
            model = zoo.causal_lm(name, 2, vocab_size=128).to(dtype)
        except ValueError as e:  # a model transformers gives no sdpa: its eager attention
            if "scaled_dot_product_attention" not in str(e):
                raise
            model = zoo.causal_lm(name, 2, vocab_size=128, _attn_implementation="eager").to(dtype)
        ids, mask = prompt()
        eager = generate(model, ids, mask, cache)
    except Exception as e:  # noqa: BLE001 - not buildable this way: listed, not fuser's failure
        return f"| {name} | not built: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report = fuser.apply(model)
            first = generate(model, ids, mask, cache)  # fuses at its first decode step
            before = layer_calls(model, report)
            again = generate(model, ids, mask, cache)
        except Exception as e:  # noqa: BLE001 - fuser's failure: the finding
            return f"| {name} | **error**: {type(e).__name__}: {str(e).splitlines()[0][:160]} | | | |"
    after = layer_calls(model, report)
    tokens = "eager's" if torch.equal(first, eager) and torch.equal(again, eager) else "**differ**"
    fused = sorted({counts["fused"] - before.get(layer, {}).get("fused", 0) for layer, counts in after.items()}) or ["none fused"]
    declined = {}
    for layer, counts in after.items():
        for why, n in counts["declined"].items():
            if n - before.get(layer, {}).get("declined", {}).get(why, 0) and f" is {PROMPT}, traced with 1" not in why:
                declined[why[:100]] = declined.get(why[:100], 0) + 1
    eager_groups = [g.eager[:100] for g in report.groups if g.report is None]
    said = sorted({str(w.message)[:120] for w in caught if str(w.message).startswith("fuser")})
    notes = "; ".join([*(f"left eager: {e}" for e in eager_groups), *(f"declined: {d}" for d in declined)]) or "-"
    return f"| {name} | {tokens} | {', '.join(map(str, fused))} | {notes} | {'; '.join(said) or '-'} |"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=list(zoo.MODELS) + list(zoo.UNSEEN))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    parser.add_argument("--out", help="write the markdown table here too")
    args = parser.parse_args(argv)
    lines = ["| model | tokens | decode steps fused a layer | else | fuser's warnings |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in args.models:
        lines.append(swept(name, getattr(torch, args.dtype), args.cache))
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
