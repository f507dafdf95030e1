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
``torch.cat``: nothing a graph can replay), a sliding-window cache and any other call run as
they are; :attr:`GraphedForward.not_captured` counts them by reason.

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
from fuser.model.decode_calls import is_decode_call
from fuser.trace.refusal import user_stacklevel

MAX_GRAPHS = 16
GRAPHED_ATTR = "_fuser_graphed"
NO_STATIC_CACHE = ("no static cache of plain layers (a dynamic cache grows by torch.cat and a sliding-window layer "
                   "keeps its length in Python: a replay would not move either on); generate(cache_implementation='static')")
AUTOGRAD = "grad is enabled (run under torch.no_grad(), as generate does)"
NOT_CUDA = "its tensors are not all on a CUDA device"


def static_cache(kwargs: dict):
    """The call's cache when a graph can replay its updates: transformers' ``StaticCache`` of
    plain ``StaticLayer`` s, which keep their length on the device; else None. A sliding-window
    layer keeps its length as a Python int, which a replay would not move on."""
    cache = kwargs.get("past_key_values")
    layers = getattr(cache, "layers", None)
    if not layers or not getattr(cache, "is_compileable", False):
        return None
    return cache if all(type(layer).__name__ == "StaticLayer" for layer in layers) else None


class Graph:
    """One captured call: its input tensors (copied into at each replay) and its outputs, the
    cache among them held as a mark (the graph must not keep the cache alive)."""

    def __init__(self, inputs: list[torch.Tensor], graph: torch.cuda.CUDAGraph, output, cache):
        self.inputs, self.graph, self.cache = inputs, graph, weakref.ref(cache)
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
        why = (NO_STATIC_CACHE if cache is None else AUTOGRAD if torch.is_grad_enabled()
               else NOT_CUDA if not tensors or not all(t.is_cuda for t in tensors) else None)  # fmt: skip
        key = None if why else (_identity(cache), spec, tuple(_signature(x) for x in leaves))
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
            return graph.replay(tensors, cache)
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
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                output = self.inner(*static_args, **static_kwargs)
        except Exception as e:  # noqa: BLE001 - this key runs as it is, said once
            self.refused[key] = f"its capture failed: {type(e).__name__}: {e}"
            self._not_captured(self.refused[key])
            return self.inner(*args, **kwargs)
        self.graphs[key] = Graph(inputs, graph, output, cache)
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
