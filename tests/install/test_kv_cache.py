"""fuser.install.kv_cache: transformers' StaticCache written by one kernel, against transformers' own
``StaticCache.update`` on the same cache (a copy is exact, so the caches must be equal), and
every cache or call it does not take running transformers' code."""

import copy

import pytest
import torch
from transformers import Qwen3Config, StaticCache

from fuser.install import kv_cache

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SLOTS = 16


def cache(heads: int, dim: int, batch: int, dtype, prefix: int = 5, layer_types=("full_attention",), device="cpu") -> StaticCache:
    """A StaticCache of ``SLOTS`` slots holding ``prefix`` tokens (written by transformers)."""
    config = Qwen3Config(num_hidden_layers=len(layer_types), num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=dim, hidden_size=heads * dim, layer_types=list(layer_types), use_sliding_window=True,
                         sliding_window=4)  # fmt: skip
    made = StaticCache(config=config, max_cache_len=SLOTS)
    g = torch.Generator().manual_seed(prefix)
    for i in range(len(layer_types) if prefix else 0):
        k, v = (torch.randn(batch, heads, prefix, dim, generator=g).to(dtype).to(device) for _ in range(2))
        made.update(k, v, i)
    return made


class Taken:
    """Counts the calls :func:`fuser.install.kv_cache.update` writes with its kernel and those it hands to transformers."""

    def __init__(self, monkeypatch):
        self.kernel = self.transformers = 0
        found = kv_cache.static_layer

        def spy(*args):
            layer = found(*args)
            if layer is None:
                self.transformers += 1
            else:
                self.kernel += 1
            return layer

        monkeypatch.setattr(kv_cache, "static_layer", spy)


def states(batch, heads, steps, dim, dtype, seed=0, transposed_values=False):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, steps, dim, generator=g).to(dtype)
    if transposed_values:  # as a projection's output viewed (batch, steps, heads, dim) then transposed
        v = torch.randn(batch, steps, heads, dim, generator=g).to(dtype).transpose(1, 2)
    else:
        v = torch.randn(batch, heads, steps, dim, generator=g).to(dtype)
    return k, v


def assert_same_cache(got: StaticCache, expected: StaticCache):
    for a, b in zip(got.layers, expected.layers):
        assert torch.equal(a.cumulative_length, b.cumulative_length)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, heads, dim, steps", [(1, 2, 64, 1), (3, 8, 128, 1), (2, 4, 80, 1), (5, 3, 24, 3)])
def test_the_kernel_writes_the_cache_as_transformers_does(monkeypatch, dtype, batch, heads, dim, steps):
    expected = cache(heads, dim, batch, dtype)
    got = copy.deepcopy(expected)
    taken = Taken(monkeypatch)
    for step in range(2):  # the second write lands after the first: the length advanced on the device
        k, v = states(batch, heads, steps, dim, dtype, seed=step, transposed_values=step == 1)
        keys, values = kv_cache.update(got, k, v, 0)
        want_keys, want_values = expected.update(k, v, 0)
        assert keys is got.layers[0].keys and values is got.layers[0].values  # the cache's own tensors, as transformers returns
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert_same_cache(got, expected)
    assert (taken.kernel, taken.transformers) == (2, 0)


def test_the_kernel_moves_the_length_on_itself(monkeypatch):
    """No launch besides the kernel: its last program to finish adds to the length, and the
    count of programs done is back at zero for the next call."""
    expected = cache(3, 16, 2, torch.float32)
    got = copy.deepcopy(expected)

    def no_add(*args, **kwargs):
        raise AssertionError("the length was added to outside the kernel")

    for step in range(3):
        k, v = states(2, 3, 2, 16, torch.float32, seed=step)
        with monkeypatch.context() as patched:
            patched.setattr(torch.Tensor, "add_", no_add)
            kv_cache.update(got, k, v, 0)
        expected.update(k, v, 0)
        assert int(kv_cache.done_count(got.layers[0].cumulative_length)) == 0
    assert_same_cache(got, expected)


def test_each_layer_of_the_cache_is_written_at_its_own_length(monkeypatch):
    expected = cache(2, 32, 2, torch.bfloat16, layer_types=("full_attention", "full_attention"))
    expected.layers[1].update(*states(2, 2, 2, 32, torch.bfloat16, seed=7))  # layer 1 two tokens ahead
    got = copy.deepcopy(expected)
    taken = Taken(monkeypatch)
    for layer in (1, 0):
        k, v = states(2, 2, 1, 32, torch.bfloat16, seed=layer)
        kv_cache.update(got, k, v, layer)
        expected.update(k, v, layer)
    assert_same_cache(got, expected)
    assert taken.kernel == 2


def assert_same_window(got, expected):
    for a, b in zip(got.layers, expected.layers):
        assert getattr(a, "cumulative_length_int", None) == getattr(b, "cumulative_length_int", None)
    assert_same_cache(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prefix", [1, 3, 6])
def test_a_sliding_window_is_written_as_transformers_writes_it_while_it_fills_and_once_it_is_full(monkeypatch, dtype, prefix):
    """A window of 4 slots after ``prefix`` tokens, then one token a step: written at its device
    length until it is full, then rolled by one — the window, both lengths and the returned
    tensors as transformers' own update leaves and returns them."""
    expected = cache(2, 32, 2, dtype, prefix=prefix, layer_types=("full_attention", "sliding_attention"))
    assert type(expected.layers[1]).__name__ == "StaticSlidingWindowLayer" and expected.layers[1].max_cache_len == 4
    got = copy.deepcopy(expected)
    taken = Taken(monkeypatch)
    for step in range(6):
        k, v = states(2, 2, 1, 32, dtype, seed=step)
        keys, values = kv_cache.update(got, k, v, 1)
        want_keys, want_values = expected.update(k, v, 1)
        assert keys is got.layers[1].keys and values is got.layers[1].values
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values), step
        assert_same_window(got, expected)
    assert (taken.kernel, taken.transformers) == (6, 0)


def test_a_step_that_fills_a_sliding_window_up_runs_transformers_update(monkeypatch):
    """Two tokens into a window of 4 holding 3: transformers concatenates and returns the
    concatenation (longer than the window); that step is its own."""
    expected = cache(2, 32, 2, torch.float32, prefix=3, layer_types=("sliding_attention",))
    got = copy.deepcopy(expected)
    k, v = states(2, 2, 2, 32, torch.float32)
    keys, values = kv_cache.update(got, k, v, 0)
    want_keys, want_values = expected.update(k, v, 0)
    assert keys.shape[2] == 5 and torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert_same_window(got, expected)


def test_other_caches_layers_and_calls_run_transformers_update(monkeypatch):
    cases = [
        (cache(2, 32, 2, torch.float32, prefix=0), 0, states(2, 2, 1, 32, torch.float32)),  # not yet initialised
        (cache(2, 32, 2, torch.float32), 0, states(2, 2, 1, 32, torch.bfloat16)),  # another dtype (transformers casts)
        (cache(2, 32, 2, torch.float32), 0, states(3, 2, 1, 32, torch.float32)),  # another batch: transformers raises
    ]
    taken = Taken(monkeypatch)
    for made, layer, (k, v) in cases:
        expected = copy.deepcopy(made)
        try:
            want = expected.update(k, v, layer)
        except RuntimeError as e:
            with pytest.raises(type(e)):
                kv_cache.update(made, k, v, layer)
        else:
            got = kv_cache.update(made, k, v, layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert_same_cache(made, expected)
    assert (taken.kernel, taken.transformers) == (0, len(cases))


def test_writes_past_the_end_of_the_cache_are_dropped(monkeypatch):
    made = cache(2, 16, 1, torch.float32, prefix=SLOTS - 1)
    before = copy.deepcopy(made)
    k, v = states(1, 2, 2, 16, torch.float32)
    kv_cache.update(made, k, v, 0)  # the last slot, and one past the end
    layer, old = made.layers[0], before.layers[0]
    assert torch.equal(layer.keys[:, :, -1], k[:, :, 0]) and torch.equal(layer.values[:, :, -1], v[:, :, 0])
    assert torch.equal(layer.keys[:, :, :-1], old.keys[:, :, :-1])
    assert int(layer.cumulative_length) == SLOTS + 1  # advanced as transformers would have


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_in_a_cuda_graph_each_replay_writes_the_next_slot(monkeypatch, dtype, pdl):
    """The length is read on the device: one captured update, replayed, writes one slot after
    another, as transformers' update called that many times does (launched with PDL too, where
    the GPU has it: the kernel waits for the one before it)."""
    update = kv_cache.updater(pdl and torch.cuda.get_device_capability() >= (9, 0))
    expected = cache(8, 128, 4, dtype, device="cuda")
    got = copy.deepcopy(expected)
    taken = Taken(monkeypatch)
    k, v = (t.cuda() for t in states(4, 8, 1, 128, dtype, seed=0))
    update(got, k, v, 0)  # compiles the kernel, outside the capture
    expected.update(k, v, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        update(got, k, v, 0)
    for step in range(1, 4):
        new_k, new_v = (t.cuda() for t in states(4, 8, 1, 128, dtype, seed=step))
        k.copy_(new_k)
        v.copy_(new_v)
        graph.replay()
        expected.update(new_k, new_v, 0)
    torch.cuda.synchronize()
    assert_same_cache(got, expected)
    assert taken.kernel == 2


@pytest.mark.parametrize("filled, steps", [(1, 1), (3, 1), (4, 1), (6, 1), (2, 2), (3, 2), (4, 2)])
def test_a_window_s_branch_is_the_one_transformers_update_takes(filled, steps):
    """fuser.model.cuda_graphs keys a graph by each window's branch: ``filling`` where
    transformers writes at the device length (its own tensors returned, the length moved on),
    ``full`` where it rolls by one (its own tensors, the device length left), None where it
    concatenates (a longer tensor returned)."""
    from fuser.model.cuda_graphs import window_branches

    made = cache(2, 16, 1, torch.float32, prefix=filled, layer_types=("sliding_attention",))
    layer = made.layers[0]
    length = int(layer.cumulative_length)
    (branch,) = window_branches(made, steps) or (None,)
    keys, _ = made.update(*states(1, 2, steps, 16, torch.float32), 0)
    took = ("concatenated" if keys is not layer.keys else "filling" if int(layer.cumulative_length) == length + steps
            else "full" if int(layer.cumulative_length) == length else "?")  # fmt: skip
    assert took == (branch or "concatenated"), (branch, took)
