"""What the guard costs per call, on the CPU: the checks a fused module's forward makes before
it runs the fused graph (the call's structure and tensors, autograd, the module's state), timed
on transformers' decoder layers at the zoo's tiny dims (the checks do not depend on the sizes).

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/guard_cost.py
"""

from __future__ import annotations

import timeit

import torch

import fuser
from examples.zoo import layers as zoo
from fuser.install.splice import STATE_ATTR, wants_grad


def guard_us(model: str, number: int = 2000) -> dict:
    layer, args, kwargs = zoo.build(model, T=1)
    fuser.apply(layer, args, example_kwargs=kwargs)
    state = layer.__dict__[STATE_ATTR]

    def checks():
        traced_args, why = state.guard.check(args, kwargs)
        assert why is None
        assert not wants_grad(layer, traced_args)
        assert state.stale(layer)[0] is None

    with torch.no_grad():
        checks()
        seconds = min(timeit.repeat(checks, number=number, repeat=5)) / number
    return {"model": model, "guard_us": round(seconds * 1e6, 1)}


if __name__ == "__main__":
    for name in ("qwen3", "qwen3_moe", "deepseek_v3"):
        print(guard_us(name))
