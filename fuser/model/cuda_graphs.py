"""cuda_graphs: ``fuser.apply(model, cuda_graphs=True)`` — decode steps replayed from CUDA graphs,
with no compile.

Once the model is fused (at its first decode call, :mod:`fuser.model.lazy_model`), its forward is wrapped
(:class:`GraphedForward`): a decode call (one new token per sequence) with a static cache, no
autograd and outside Dynamo and any capture, is keyed by everything a graph bakes in — the
cache object, and every tensor's shape, dtype and device and every other value of the call
(:func:`static_cache` says which caches a graph can replay).
The first call of a key runs as it is (the fused forward: every kernel it launches at that
batch size is compiled then); the second is captured and replayed, and every later one copies
its tensors into the graph's inputs and replays. A prefill, a dynamic cache (it grows by
``torch.cat``: nothing a graph can replay) and any other call run as they are;
:attr:`GraphedForward.not_captured` counts them by reason.

A sliding-window layer of a static cache keeps a count of its tokens in Python, which picks the
branch of its update (written at its device length while the window is not full; rolled by one
once it is) and the mask's offset. A graph is keyed by the branch of each such layer, and after
a replay the count moves on as the captured call moved it. The step in which a window fills up
(its update concatenates) runs as it is. Once a window is full the mask moves with the count, so
a graph replays it only where the mask is an input of the call (``generate`` builds it outside
the forward for a static cache), not built inside the forward from the count.

Nothing is compiled inside a capture (the fused kernels raise
:class:`fuser.codegen.emit.CaptureCompileError` rather than compile there); a call that cannot
be captured (an eager op that syncs with the host) runs as it is, and its key is never tried
again, with one warning. The outputs of a replay are copies (the graph's own are overwritten
by the next replay). A cache's graphs are dropped with the cache (``generate`` makes a new one
per call), and at most :data:`MAX_GRAPHS` are kept, least recently used dropped.
"""

from __future__ import annotations

import collections
import copy
import warnings
import weakref

import torch
import torch.utils._pytree as pytree

from fuser.codegen.capture_guard import capturing
from fuser.install.kv_cache import CACHE_MODULE, STATIC_LAYERS
from fuser.model.decode_calls import is_decode_call
from fuser.trace.refusal import user_stacklevel

MAX_GRAPHS = 16
GRAPHED_ATTR = "_fuser_graphed"
NO_STATIC_CACHE = ("no static cache of transformers' own layers (a dynamic cache grows by torch.cat: a replay would "
                   "not move it on); generate(cache_implementation='static')")
WINDOW_FILLS = "a sliding-window layer fills up in this step (its update concatenates)"
MASK_FROM_COUNT = ("a full sliding window with no mask given: the forward builds it from the window's Python count, "
                   "which a replay would not move on")
AUTOGRAD = "grad is enabled (run under torch.no_grad(), as generate does)"
NOT_CUDA = "its tensors are not all on a CUDA device"


def static_cache(kwargs: dict):
    """The call's cache when a graph can replay its updates: transformers' ``StaticCache`` of its
    own ``StaticLayer`` s (their length kept on the device) and ``StaticSlidingWindowLayer`` s
    (see :func:`window_branches`); else None."""
    cache = kwargs.get("past_key_values")
    layers = getattr(cache, "layers", None)
    if not layers or not getattr(cache, "is_compileable", False):
        return None
    kinds = {(type(layer).__module__, type(layer).__name__) for layer in layers}
    return cache if kinds <= {(CACHE_MODULE, name) for name in STATIC_LAYERS} else None


def window_branches(cache, tokens: int) -> tuple[str, ...] | None:
    """The branch each sliding-window layer's update takes in a step of ``tokens`` new tokens:
    ``filling`` (written at its device length) or ``full`` (rolled by one); None where a window
    fills up in the step (transformers concatenates, at sizes a replay would not keep)."""
    branches = []
    for layer in _windows(cache):
        filled, window = layer.cumulative_length_int, layer.max_cache_len
        if filled + tokens <= window:
            branches.append("filling")
        elif filled >= window and tokens == 1:
            branches.append("full")
        else:
            return None
    return tuple(branches)


def _windows(cache) -> list:
    return [layer for layer in cache.layers if type(layer).__name__ == "StaticSlidingWindowLayer"]


def _mask_given(kwargs: dict) -> bool:
    """Is the call's attention mask built outside the forward (a 4-D tensor, or a dict of them
    per layer type, as ``generate`` passes with a static cache)?"""
    mask = kwargs.get("attention_mask")
    masks = list(mask.values()) if isinstance(mask, dict) else [mask]
    return bool(masks) and all(isinstance(m, torch.Tensor) and m.dim() == 4 for m in masks)


class Graph:
    """One captured call: its input tensors (copied into at each replay) and its outputs, the
    cache among them held as a mark (the graph must not keep the cache alive); ``counted``: how
    far the call moved on each sliding-window layer's Python count of tokens."""

    def __init__(self, inputs: list[torch.Tensor], graph: torch.cuda.CUDAGraph, output, cache, counted: list[int]):
        self.inputs, self.graph, self.cache, self.counted = inputs, graph, weakref.ref(cache), counted
        leaves, self.spec = pytree.tree_flatten(output)
        self.outputs = [_CACHE if leaf is cache else leaf for leaf in leaves]

    def replay(self, tensors: list[torch.Tensor], cache):
        for static, value in zip(self.inputs, tensors):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        self.graph.replay()
        leaves = [cache if x is _CACHE else x.clone() if isinstance(x, torch.Tensor) else x for x in self.outputs]
        return pytree.tree_unflatten(leaves, self.spec)


_CACHE = object()


class GraphedForward:
    """The model's forward, its decode steps with a static cache replayed from CUDA graphs."""

    def __init__(self, model: torch.nn.Module, inner):
        self.model, self.inner = model, inner  # inner: the forward to run and capture
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.seen: set = set()  # keys run once (their kernels compiled)
        self.refused: dict = {}  # key -> why it could not be captured
        self.pool = self.stream = None
        self.replays = 0
        self.not_captured: dict[str, int] = {}  # decode calls run without a graph, by reason
        self.warned = False

    def __deepcopy__(self, memo: dict) -> "GraphedForward":
        """A copy of the model replays graphs of its own, captured anew."""
        return GraphedForward(copy.deepcopy(self.model, memo), copy.deepcopy(self.inner, memo))

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or capturing() or not is_decode_call(args, kwargs):
            return self.inner(*args, **kwargs)  # a prefill, or the engine's own capture
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        cache = static_cache(kwargs)
        branches = None if cache is None else window_branches(cache, tokens=1)  # a decode call
        why = (NO_STATIC_CACHE if cache is None else WINDOW_FILLS if branches is None
               else MASK_FROM_COUNT if "full" in branches and not _mask_given(kwargs)
               else AUTOGRAD if torch.is_grad_enabled()
               else NOT_CUDA if not tensors or not all(t.is_cuda for t in tensors) else None)  # fmt: skip
        key = None if why else (_identity(cache), branches, spec, tuple(_signature(x) for x in leaves))
        if key in self.refused:
            why = self.refused[key]
        if why:
            self._not_captured(why)
            return self.inner(*args, **kwargs)
        graph = self.graphs.get(key)
        if graph is not None and graph.cache() is not cache:  # another cache at a freed one's address
            del self.graphs[key]
            self.seen.discard(key)
            graph = None
        if graph is not None:
            self.graphs.move_to_end(key)
            self.replays += 1
            output = graph.replay(tensors, cache)
            for layer, counted in zip(_windows(cache), graph.counted):
                layer.cumulative_length_int += counted  # as the captured call moved it on
            return output
        if key not in self.seen:
            self.seen.add(key)  # the first call: its kernels compile, outside any capture
            return self._on_capture_stream(args, kwargs)
        return self._capture(key, args, kwargs, tensors, cache)

    def _on_capture_stream(self, args, kwargs):
        """The call, run on the stream later captures use (as a warm-up before a capture is)."""
        self.stream = self.stream or torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            output = self.inner(*args, **kwargs)
        torch.cuda.synchronize()
        return output

    def _forget(self) -> None:
        """Drop the graphs of caches that are gone."""
        for key in [k for k, graph in self.graphs.items() if graph.cache() is None]:
            del self.graphs[key]
            self.seen.discard(key)

    def _not_captured(self, why: str) -> None:
        self.not_captured[why] = self.not_captured.get(why, 0) + 1
        if not self.warned:
            self.warned = True
            warnings.warn(f"fuser: a decode step of {type(self.model).__name__} runs without a CUDA graph: {why} "
                          "(later ones do not warn; GraphedForward.not_captured counts them)", stacklevel=user_stacklevel())

    def _capture(self, key, args, kwargs, tensors, cache):
        inputs = [t.clone() for t in tensors]
        it = iter(inputs)
        static_args, static_kwargs = pytree.tree_map(lambda x: next(it) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        self.stream = self.stream or torch.cuda.Stream()
        torch.cuda.synchronize()
        counts = [layer.cumulative_length_int for layer in _windows(cache)]
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                output = self.inner(*static_args, **static_kwargs)
        except Exception as e:  # noqa: BLE001 - this key runs as it is, said once
            for layer, count in zip(_windows(cache), counts):
                layer.cumulative_length_int = count  # the call runs again, from where it was
            self.refused[key] = f"its capture failed: {type(e).__name__}: {e}"
            self._not_captured(self.refused[key])
            return self.inner(*args, **kwargs)
        counted = [layer.cumulative_length_int - count for layer, count in zip(_windows(cache), counts)]
        self.graphs[key] = Graph(inputs, graph, output, cache, counted)
        weakref.finalize(cache, self._forget)  # its graphs go with the cache
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        self.replays += 1
        return self.graphs[key].replay(tensors, cache)


def _identity(cache) -> tuple:
    """The cache object and the memory of its layers' tensors, which a graph bakes in."""
    layers = getattr(cache, "layers", ())
    held = (getattr(layer, name, None) for layer in layers for name in ("keys", "values"))
    return (id(cache), tuple(t.data_ptr() for t in held if isinstance(t, torch.Tensor)))


def _signature(value):
    """What a graph bakes in of one leaf of the call: a tensor's layout; a plain value itself;
    any other object (the cache) by its id, so that a key does not keep it alive."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.stride())
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    return ("object", id(value))


def wrap(model: torch.nn.Module) -> None:
    """Put :class:`GraphedForward` over the model's forward (the fused one, when fused)."""
    inner = model.__dict__.get("forward") or type(model).forward.__get__(model)
    graphed = GraphedForward(model, inner)
    model.__dict__[GRAPHED_ATTR] = graphed
    model.__dict__["forward"] = graphed


def unwrap(model: torch.nn.Module) -> None:
    graphed = model.__dict__.pop(GRAPHED_ATTR, None)
    if graphed is None:
        return
    if model.__dict__.get("forward") is graphed:
        del model.__dict__["forward"]
        if not _is_bound_class_forward(model, graphed.inner):
            model.__dict__["forward"] = graphed.inner


def _is_bound_class_forward(model, forward) -> bool:
    return getattr(forward, "__func__", None) is type(model).forward and getattr(forward, "__self__", None) is model
