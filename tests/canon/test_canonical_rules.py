"""The canonicaliser's rules of their own (fuser/canon/registry.py): each is asked under the name
canon reads, registered once, and used for the calls it names."""

import pytest
import torch

from fuser.canon.canonicalize import canonicalize
from fuser.canon.registry import ANY_DTYPE, SEVERAL, TENSOR, canonical
from fuser.ir import ops
from fuser.trace.tracing import trace


def test_a_rule_is_registered_under_a_name_canon_asks_for():
    """Another spelling of a table op is folded into its name before the rules are asked: a
    rule under that spelling would never run."""
    for table in (TENSOR, ANY_DTYPE, SEVERAL):
        assert not set(table) & set(ops.SPELLINGS), sorted(set(table) & set(ops.SPELLINGS))


def test_a_rule_registered_twice_is_refused():
    with pytest.raises(ValueError, match="two canonical forms of 'layer_norm'"):
        canonical("layer_norm")(lambda cz, node: None)
    assert TENSOR["layer_norm"].__module__ == "fuser.canon.ops"


def ops_of(fn, *inputs) -> list[str]:
    traced = trace(fn, inputs, batch_inputs={name: 0 for name in fn.__code__.co_varnames[: len(inputs)]})
    return [cop.op for node, cop in canonicalize(traced).items() if node.op == "call_function" or node.op == "call_method"]


def test_each_kind_of_rule_is_used():
    x = torch.randn(3, 8)
    assert ops_of(lambda x: x.masked_fill(x > 0, 0.0), x) == ["gt", "where"]
    assert ops_of(lambda x: torch.nn.functional.gelu(x, approximate="tanh"), x) == ["gelu_tanh"]
    assert ops_of(lambda x: torch.topk(x, 2, dim=-1).values, x) == ["topk", "topk_values"]
    assert ops_of(lambda x: torch.max(x, -1).indices, x) == ["max_along", "argmax"]
    assert ops_of(lambda x: torch.cumsum(x.long(), -1), x)[-1] == "cumsum"
