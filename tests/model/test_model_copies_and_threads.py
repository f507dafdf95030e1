"""A model fused layer by layer under threads, pickled and deep-copied: every thread's result is
eager's, a pickle is the eager model, a deep copy is a fused model of its own."""

from __future__ import annotations

import copy
import io
import threading

import torch

import fuser
from fuser.validate.tolerance import KERNEL, LAYER, mismatch
from tests.install.test_once_per_forward import Stack, eager, inputs
from tests.model.test_model import causal_lm, fused_layers

THREADS, CALLS = 8, 100


def run_in_threads(call, count: int = CALLS) -> list[str]:
    """``call(thread, i)`` for ``count`` calls in each of THREADS threads at once; the problems
    it returned or raised."""
    problems: list[str] = []
    start = threading.Barrier(THREADS)

    def work(thread):
        start.wait()
        for i in range(count):
            try:
                problem = call(thread, i)
            except Exception as e:  # noqa: BLE001 - every thread's failure is reported
                problem = f"{type(e).__name__}: {e}"
            if problem:
                problems.append(f"thread {thread} call {i}: {problem}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return problems


def test_a_model_with_a_kernel_shared_by_its_layers_gives_each_thread_eagers_result():
    model = Stack()
    report = fuser.apply(model, inputs(0))
    assert any(g.report.shared for g in report.groups), report.text()
    cases = [inputs(seed) for seed in range(5)]
    expected = [eager(model, *case) for case in cases]

    def call(thread, i):
        case = (thread + i) % len(cases)
        with torch.no_grad():
            got = model(*cases[case])
        return mismatch(got, expected[case], "output", LAYER)

    assert run_in_threads(call) == []


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 32))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) + x


def test_a_fused_module_gives_each_thread_eagers_result():
    module = Norm()
    cases = [torch.randn(3 + k, 32, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    fuser.apply(module, (cases[0],))
    expected = [Norm.forward(module, x).detach() for x in cases]

    def call(thread, i):
        case = (thread * 3 + i) % len(cases)
        with torch.no_grad():
            return mismatch(module(cases[case]), expected[case], "output", KERNEL)

    assert run_in_threads(call) == []


def test_a_fused_causal_lm_gives_each_thread_eagers_logits():
    model = causal_lm("qwen3", layers=2)
    ids = torch.randint(0, 128, (3, 4), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[0, 0] = 0  # a padded position: the model makes and passes a mask
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    fuser.apply(model, (), example_kwargs=dict(input_ids=ids, attention_mask=mask, use_cache=False))
    assert fused_layers(model)

    def call(thread, i):
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return mismatch(got, expected, "logits", LAYER)

    assert run_in_threads(call, count=3) == []


def no_trace_of_fuser(model: torch.nn.Module) -> list[str]:
    """What of fuser's a model still holds: attributes, instance hooks, forward hooks."""
    found = []
    for name, m in model.named_modules():
        found += [f"{name}.{k}" for k in m.__dict__ if k.startswith("_fuser") or k in ("__getstate__", "__deepcopy__", "forward")]
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
        found += [f"{name}: hook {h.__module__}.{h.__name__}" for h in hooks if h.__module__.startswith("fuser")]
    return found


def test_torch_save_of_a_fused_model_gives_the_eager_model():
    model = Stack()
    fuser.apply(model, inputs(0))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert no_trace_of_fuser(loaded) == []
    with torch.no_grad():
        assert torch.equal(loaded(*inputs(1)), eager(model, *inputs(1)))
    fuser.apply(loaded, inputs(0))  # and it fuses again
    assert all(fuser.is_fused(layer) for layer in loaded.layers)
    assert all(fuser.is_fused(layer) for layer in model.layers)  # saving left the original fused


def test_a_deep_copy_of_a_fused_model_is_fused_on_its_own():
    model = Stack()
    fuser.apply(model, inputs(0))
    twin = copy.deepcopy(model)
    assert all(fuser.is_fused(layer) for layer in twin.layers)
    for a, b in zip(model.layers, twin.layers):
        assert a.__dict__["_fuser_state"] is not b.__dict__["_fuser_state"]
        assert b.forward.module is b  # the copy's guarded forward runs the copy
    assert twin.__dict__["_fuser_shared_hooks"] is not model.__dict__["_fuser_shared_hooks"]
    expected = {m: eager(m, *inputs(1)) for m in (model, twin)}

    def call(thread, i):  # the original and its copy at once: no state of one is the other's
        m = (model, twin)[thread % 2]
        with torch.no_grad():
            return mismatch(m(*inputs(1)), expected[m], "output", LAYER)

    assert run_in_threads(call, count=10) == []
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    fuser.restore(model)
    assert no_trace_of_fuser(model) == []
    with torch.no_grad():
        got = twin(*inputs(1))
    assert mismatch(got, eager(twin, *inputs(1)), "output", LAYER) is None
    assert not torch.allclose(got, eager(model, *inputs(1)))  # the twin's own weights, not the halved ones
    fuser.restore(twin)
    assert no_trace_of_fuser(twin) == []
