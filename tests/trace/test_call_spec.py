"""A call's tensors in placeholder order (CallSpec.flatten), as the guard reads them at every
call: the same answer, and the same reason for a call that differs, whether the structure is
read directly (plain tensors, tuples and dicts of them) or through pytree."""

import pytest
import torch

from fuser.trace.call_spec import CallSpec


def forward(hidden, mask=None, *extra, position_embeddings=None, scale=1.0, **kwargs):
    return hidden


def example():
    t = [torch.randn(2, 3) for _ in range(4)]
    return (t[0], None), dict(position_embeddings=(t[1], t[2]), scale=0.5, cache={"k": t[3], "n": 3})


def test_the_tensors_come_in_placeholder_order():
    args, kwargs = example()
    spec = CallSpec.of(forward, args, kwargs)
    tensors, why = spec.flatten(args, kwargs)
    assert why is None
    expected = [args[0], *kwargs["position_embeddings"], kwargs["cache"]["k"]]
    assert len(tensors) == len(expected) and all(a is b for a, b in zip(tensors, expected))
    assert spec.names == ["hidden", "position_embeddings_0", "position_embeddings_1", "cache_k"]
    fresh = [torch.randn(2, 3) for _ in range(4)]
    again, why = spec.flatten((fresh[0], None), dict(position_embeddings=(fresh[1], fresh[2]), scale=0.5, cache={"k": fresh[3], "n": 3}))
    assert why is None and all(a is b for a, b in zip(again, fresh))


@pytest.mark.parametrize("change, reason", [
    (lambda a, k: ((a[0], a[0]), k), "mask is tensor("),
    (lambda a, k: (a, {**k, "position_embeddings": (a[0],)}), "position_embeddings has another structure than traced"),
    (lambda a, k: (a, {**k, "position_embeddings": [*k["position_embeddings"]]}), "position_embeddings has another structure than traced"),
    (lambda a, k: (a, {**k, "scale": 0.25}), "scale is 0.25, traced with 0.5"),
    (lambda a, k: (a, {**k, "cache": {"n": 3, "k": k["cache"]["k"]}}), "kwargs has another structure than traced"),
    (lambda a, k: (a, {**k, "cache": {"k": k["cache"]["k"], "n": 4}}), "cache['n'] is 4, traced with 3"),
    (lambda a, k: ((*a, a[0]), k), "extra has another structure than traced (a tuple of 1)"),
    (lambda a, k: (a, {**k, "other": 1}), "kwargs has another structure than traced"),
])  # fmt: skip
def test_a_call_that_differs_says_how(change, reason):
    args, kwargs = example()
    spec = CallSpec.of(forward, args, kwargs)
    tensors, why = spec.flatten(*change(args, kwargs))
    assert tensors is None and reason in why, why


def test_a_call_binding_its_arguments_otherwise_is_bound_again():
    args, kwargs = example()
    spec = CallSpec.of(forward, args, kwargs)
    by_keyword = dict(kwargs, hidden=args[0], mask=None)
    tensors, why = spec.flatten((), by_keyword)
    assert why is None and tensors[0] is args[0]
    assert spec.flatten((), {})[1] == "missing a required argument: 'hidden'"


def test_fx_s_immutable_dicts_and_lists_are_the_dicts_and_lists_they_stand_for():
    """A call made from an fx graph (a fused forward that calls the module: transformers'
    DeepSeek-V4 model hands its layers ``position_embeddings={"main": ..., "compress": ...}``)
    passes fx's ``immutable_dict`` and ``immutable_list``; an eager call, plain ones. Either way
    round, the call has the traced structure; a tuple in place of a list still does not."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    t = [torch.randn(2, 3) for _ in range(3)]
    plain = dict(position_embeddings={"main": (t[0], t[1])}, cache=[t[2], 3])
    from_fx = dict(position_embeddings=immutable_dict({"main": (t[0], t[1])}), cache=immutable_list([t[2], 3]))
    for traced, called in ((plain, from_fx), (from_fx, plain)):
        spec = CallSpec.of(forward, (t[0],), traced)
        tensors, why = spec.flatten((t[0],), called)
        assert why is None and [id(x) for x in tensors] == [id(x) for x in (t[0], t[0], t[1], t[2])]
    spec = CallSpec.of(forward, (t[0],), plain)
    tensors, why = spec.flatten((t[0],), dict(plain, cache=(t[2], 3)))
    assert tensors is None and why.startswith("kwargs has another structure than traced"), why
