"""Why layer 0 of a DeepSeek-V4-Flash-shape model (8 routed experts) disagrees with its eager
forward after fusing, on the H200: how far eager's own output moves when its input moves by
bf16 rounding, against how far the fused layer is from it.

    PYTHONPATH=. python benchmarks/probe_layer0.py [LAYERS]
"""

from __future__ import annotations

import copy
import sys

import torch

import fuser
from benchmarks.bench_decode import causal_lm, prefilled, sharing_weights, step
from fuser.model.fuse_model import _batch_inputs
from fuser.model.recording import record_calls as _record_calls
from fuser.pipeline.fuse_module import plan, tensors_of
from fuser.trace.call_spec import with_state_copied
from fuser.install.splice import install, restore
from fuser.validate.tolerance import LAYER, mismatch
from fuser.trace.tracing import preserved_state


def run(layer, args, kwargs):
    args, kwargs = with_state_copied(args, kwargs)
    with preserved_state(layer, tensors_of(args, kwargs)), torch.no_grad():
        return tensors_of((layer(*args, **kwargs),))[0]


def per_token(a, b) -> list[float]:
    """Each token's normwise distance of ``a`` from ``b``."""
    a, b = a.float().flatten(1), b.float().flatten(1)
    return [round(x, 4) for x in ((a - b).norm(dim=1) / b.norm(dim=1)).tolist()]


def main(layers: int):
    model = causal_lm("deepseek_v4_flash", layers=layers, n_routed_experts=8)
    print("hash layers:", getattr(model.config, "num_hash_layers", None), flush=True)
    cache, tokens = prefilled(model, 8)
    kwargs = step(model, tokens, copy.deepcopy(cache))
    target = sharing_weights(model)
    report = fuser.apply(target, (), example_kwargs=kwargs)
    for g in report.groups:
        print("group", g.layers, "eager:", g.eager, "near ties:", g.near_ties, flush=True)
    fuser.restore(target)
    for index in (0, 1):
        layer = model.model.layers[index]
        calls = _record_calls(model, (), kwargs, [layer])
        args, kw, expected = calls[id(layer)]
        hidden = args[0]
        streams_alike = bool((hidden - hidden[:, :, :1]).abs().max() == 0) if hidden.dim() == 4 else None
        print(f"layer {index}: input {tuple(hidden.shape)} {hidden.dtype}, its streams identical: {streams_alike}", flush=True)
        base = run(layer, args, kw)
        print("  eager again vs recorded:", mismatch(base, expected, "eager again", LAYER), flush=True)
        generator = torch.Generator("cuda").manual_seed(index)
        for which in ("each element", "every stream alike"):
            noise = torch.randn(hidden.shape if which == "each element" else hidden[:, :, :1].shape, device="cuda", generator=generator)
            noisy = (hidden.float() * (1 + 2.0**-9 * noise)).to(hidden.dtype)
            moved = (noisy != hidden).float().mean().item()
            out = run(layer, (noisy, *args[1:]), kw)
            err = ((out.float() - base.float()).norm() / base.float().norm()).item()
            print(f"  eager on its input moved by half a bf16 ulp ({which}, {moved:.0%} of elements moved): normwise {err:.4f}", flush=True)
            print("    per token:", per_token(out, base), flush=True)
        fused_layer = sharing_weights(layer)
        p = plan(fused_layer, args, example_kwargs=kw, batch_inputs=_batch_inputs(layer, args, kw))
        install(fused_layer, p.forward, p.guard, p.report, p.constants, p.precomputed, p.literals)
        got = run(fused_layer, args, kw)
        err = ((got.float() - base.float()).norm() / base.float().norm()).item()
        print(f"  fused vs eager: normwise {err:.4f};", mismatch(got, base, "fused", LAYER), flush=True)
        print("    per token:", per_token(got, base), flush=True)
        restore(fused_layer)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
