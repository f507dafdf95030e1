"""What of a whole CausalLM's decode step stays eager: ``fuser.explain`` on each transformers model
the zoo builds (``examples/zoo/layers.py``: its models and the ``UNSEEN`` ones), two decoder
layers at tiny dims, bf16, on the CPU, given a decode step with a static cache as ``generate()``
makes it. One block a model: its glue launches per forward eager -> fused, each layer
structure's, and every op left to PyTorch with the reason — where the next launch to save is.

    TRITON_INTERPRET=1 PYTHONPATH=. python examples/zoo/decode_sweep.py [MODEL ...] [--out FILE]

A model transformers cannot build or step this way (no sdpa, a cache of its own) is listed
with the reason, not counted as a failure of fuser.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fuser  # noqa: E402
from examples.zoo import layers as zoo  # noqa: E402

BATCH, PROMPT = 3, 6


def causal_lm(model: str, layers: int = 2, attention: str | None = None) -> torch.nn.Module:
    """The model's CausalLM at the zoo's tiny dims, ``layers`` decoder layers, bf16 (attention:
    transformers' implementation to ask for, where its default is not taken)."""
    overrides = {"_attn_implementation": attention} if attention else {}
    return zoo.causal_lm(model, layers, vocab_size=128, **overrides).to(torch.bfloat16)


def decode_step(model) -> dict:
    """The keyword arguments of the step after a prompt of PROMPT tokens, its cache filled."""
    ids = torch.randint(0, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + 4)
    with torch.no_grad():
        tokens = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return dict(input_ids=tokens, past_key_values=copy.deepcopy(cache), use_cache=True, cache_position=torch.tensor([PROMPT]))


def explained(model_name: str) -> list[str]:
    try:
        try:
            model = causal_lm(model_name)
        except ValueError as e:  # a model transformers gives no sdpa: its eager attention
            if "scaled_dot_product_attention" not in str(e):
                raise
            model = causal_lm(model_name, attention="eager")
        kwargs = decode_step(model)
    except Exception as e:  # noqa: BLE001 - not buildable this way: listed, not fuser's failure
        return [f"## {model_name}: not built ({type(e).__name__}: {str(e).splitlines()[0][:160]})"]
    with torch.no_grad():
        report = fuser.explain(model, (), example_kwargs=kwargs)
    lines = [f"## {model_name}: {report.launches_before} -> {report.launches_after} glue launches a step"]
    for group in report.groups:
        if group.report is None:
            lines.append(f"- {len(group.layers)} layers left eager: {group.eager[:200]}")
            continue
        lines.append(f"- {len(group.layers)} layers ({group.layers[0]} ...): {group.report.launches_before} -> "
                     f"{group.report.launches_after} each")  # fmt: skip
        lines += [f"  - eager: `{u.node}` ({u.op}, {u.launches}): {u.reason[:220]}" for u in group.report.unfused]
    for name, other in report.others.items():
        lines += [f"- {name}: eager `{u.node}` ({u.op}, {u.launches}): {u.reason[:200]}" for u in other.unfused]
    lines += [f"- {name}: {how}" for name, how in report.handed_over.items()]
    lines += [f"- {name}: not computed by the last layer: {why}" for name, why in report.handed_over_apart.items()]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=list(zoo.MODELS) + list(zoo.UNSEEN))
    parser.add_argument("--out", help="write the markdown here too")
    args = parser.parse_args(argv)
    text = []
    for name in args.models:
        block = explained(name)
        print("\n".join(block), flush=True)
        text += block + [""]
    if args.out:
        Path(args.out).write_text("\n".join(text))


if __name__ == "__main__":
    main()
