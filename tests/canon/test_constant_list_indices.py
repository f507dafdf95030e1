"""A getitem by a constant list (Falcon's multi-query ``fused_qkv[..., [-2], :]``) is
``aten.index``: a copy, and on a GPU a host-to-device copy of the list. One that picks a run
with a constant step is held in the graph as the slice it is, a view
(fuser/trace/constant_indices.py), unless the view could show (a write into either's memory,
the value returned); any other stays an index, which the report counts as an op of its own
(fuser/canon/views.py)."""

import operator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fuser
from fuser.canon.canonicalize import canonicalize
from fuser.ir.canonical_op import UNSUPPORTED, VIEW, UNIT_VIEW
from fuser.trace.constant_indices import as_slice
from fuser.trace.tracing import trace

E = Ellipsis
ALL = slice(None)


@pytest.mark.parametrize(
    "index",
    [
        (E, [-2], ALL),  # Falcon's key
        (E, [-1], ALL),  # and value
        (ALL, ALL, ALL, [-2]),  # Falcon's new decoder architecture
        [1, 2],
        (0, ALL, [1, 2, 3]),
        (ALL, [0, 2, 4]),
        (None, E, [3]),
        (E, [0, 1, 2, 3], None),
    ],
    ids=str,
)
def test_a_run_of_a_list_picks_what_its_slice_picks(index):
    x = torch.randn(3, 5, 7, 4)
    picked = as_slice(index, tuple(x.shape))
    assert picked is not None
    entries = picked if isinstance(picked, tuple) else (picked,)
    assert not any(isinstance(e, list) for e in entries)
    view = x[picked]
    assert view.data_ptr() != 0 and view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    torch.testing.assert_close(view, x[index], rtol=0, atol=0)


@pytest.mark.parametrize(
    "index",
    [(E, [2, 1], ALL), (E, [0, 0], ALL), (E, [0, 1, 3], ALL), ([0, 1], [1, 2]), (E, [True, False, True, False]), (E, [])],
    ids=str,
)
def test_any_other_list_is_no_slice(index):
    assert as_slice(index, (3, 5, 7, 4)) is None


class _IndexCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += str(func).startswith("aten.index.")
        return func(*args, **(kwargs or {}))


def multi_query(qkv):
    """Falcon's split of a multi-query projection, then glue on each part."""
    fused = qkv.view(qkv.shape[0], 6, 8)
    q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
    return (q * k).sum(-1), torch.sigmoid(v) * 2.0


def _getitems(traced):
    return [n for n in traced.graph.nodes if n.op == "call_function" and n.target is operator.getitem]


def test_the_multi_query_split_is_held_as_views_and_no_index_runs():
    qkv = torch.randn(3, 48)
    traced = trace(multi_query, (qkv,))
    indices = [n.args[1] for n in _getitems(traced)]
    assert (E, slice(4, 5, None), ALL) in indices and (E, slice(5, 6, None), ALL) in indices, indices
    cops = canonicalize(traced)
    assert not [c.op for c in cops.values() if c.op == "index"]
    assert all(cops[n].kind in (VIEW, UNIT_VIEW) for n in _getitems(traced))
    for rows in (3, 7):  # the graph at another token count
        x = torch.randn(rows, 48)
        with _IndexCalls() as index:
            got = traced.graph_module(torch.nn.Module())(x)
        assert index.calls == 0
        for a, b in zip(got, multi_query(x)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # (the view's strides may order a sum otherwise)


class MultiQuery(torch.nn.Module):
    def forward(self, qkv):
        return multi_query(qkv)


def test_a_fused_multi_query_split_runs_no_index():
    module, x = MultiQuery(), torch.randn(5, 48)
    expected = module(x)
    report = fuser.apply(module, (torch.randn(3, 48),))
    assert not [u for u in report.unfused if "index" in u.op], report.text()
    with torch.no_grad(), _IndexCalls() as index:
        got = module(x)
    assert fuser.stats(module)[""]["fused"] == 1 and index.calls == 0
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class Scattered(torch.nn.Module):
    def forward(self, x):
        return x[:, [0, 2, 1]] * 2.0  # no run: a gather of columns, an index


def test_a_list_that_is_no_run_stays_an_index_the_report_counts():
    module = Scattered()
    traced = trace(module, (torch.randn(3, 8),))
    (getitem,) = _getitems(traced)
    assert getitem.args[1] == (ALL, [0, 2, 1])
    assert canonicalize(traced)[getitem].op == "index" and canonicalize(traced)[getitem].kind == UNSUPPORTED
    x = torch.randn(6, 8)
    expected = module(x)
    report = fuser.apply(module, (torch.randn(3, 8),))
    assert sum(u.launches for u in report.unfused if u.op == "index") == 1, report.text()
    with torch.no_grad(), _IndexCalls() as index:
        got = module(x)
    assert index.calls == 1  # the one the report counts
    torch.testing.assert_close(got, expected)


def last_token(x):
    return x[[-1]] * 2.0  # along the tokens: another row at every count


def test_a_list_along_the_tokens_that_picks_another_place_at_another_count_stays_an_index():
    traced = trace(last_token, (torch.randn(3, 8),))
    (getitem,) = _getitems(traced)
    assert getitem.args[1] == [-1]
    x = torch.randn(6, 8)
    torch.testing.assert_close(traced.graph_module(torch.nn.Module())(x), last_token(x), rtol=0, atol=0)


def written_after(x):
    h = x * 1.0
    k = h[:, [1, 2]]
    h.add_(1.0)  # a view of h would see this write; the index's copy does not
    return k * 3.0, h


def written_into(x):
    h = x * 1.0
    k = h[:, [1, 2]]
    k.mul_(2.0)  # a view would write into h
    return k + 1.0, h * 1.0


def written_after_by_an_input(x, b):
    h = x * 1.0
    k = h[:, [1, 2]]
    h.add_(b)  # zero in the example (the values agree there), not at the next call
    return k * 3.0, h


def returned(x):
    return x[:, [1, 2]]  # the caller would be given a view of its own input


@pytest.mark.parametrize("fn", [written_after, written_into, written_after_by_an_input, returned], ids=lambda f: f.__name__)
def test_where_a_view_could_show_the_index_stays(fn):
    takes_b = fn is written_after_by_an_input
    traced = trace(fn, (torch.randn(3, 8), torch.zeros(3, 8)) if takes_b else (torch.randn(3, 8),))
    assert any(n.args[1] == (ALL, [1, 2]) for n in _getitems(traced)), [n.args for n in _getitems(traced)]
    for rows in (3, 5):
        inputs = (torch.randn(rows, 8), torch.randn(rows, 8)) if takes_b else (torch.randn(rows, 8),)
        got = traced.graph_module(torch.nn.Module())(*(t.clone() for t in inputs))
        want = fn(*(t.clone() for t in inputs))
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
