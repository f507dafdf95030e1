"""repeated_rows: the token rows repeated block by block, and the elementwise ops over them,
rewritten in a traced graph over a pair of dims, the blocks and the tokens.

Llama-4's routed experts lay their input out as every expert's copy of the tokens, one block an
expert (transformers' ``Llama4TextMoe``)::

    routed_in = hidden_states.repeat(num_experts, 1)                       # [E·T, H], row e·T + t
    routed_in = routed_in * router_scores.transpose(0, 1).reshape(-1, 1)   # [E·T, 1]

Eager copies the hidden states E times, copies the transposed scores, and multiplies: three
launches, the first and the last over E·T rows. No row program runs over those rows (E·T is not
the token count, and row ``r`` reads token ``r mod T``), but the same values over ``[E, T, ...]``
are ops fuser fuses, the tokens one dim of them::

    routed_in = hidden_states.expand(E, -1, -1) * router_scores.transpose(0, 1).reshape(E, -1, 1)
    routed_in = routed_in.contiguous().view(-1, H)

one kernel writing ``[E, T, H]`` in the memory of ``[E·T, H]``, the view after it free.

The rewrite starts at ``x.repeat(E, 1, ..., 1)`` of a tensor whose dim 0 follows the tokens (E
the same at both traced sizes) and takes in the elementwise ops (pointwise ops of the op table,
casts) that read it, and those that read them, while every tensor they read is one of:

- such a value, ``[E·T, ...]`` at both traced sizes: read as ``value.reshape(E, -1, ...)``,
  or, where it is a reshape of a ``[E, T, ...]`` tensor (the transposed scores), as that
  tensor's reshape, which a kernel reads as a view;
- a tensor that does not follow the tokens and broadcasts along their dim (a weight, a scale).

What reads a rewritten value outside them gets it back as ``[E·T, ...]``: made contiguous, as
eager's value was (where it was not, nothing is rewritten), and viewed. Values do not change:
each op computes the same elements from the same elements, only indexed by two dims.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fuser.ir.canonical_op import FOLDED_LAUNCHES, op_name, writes_into
from fuser.ir.ops import POINTWISE, SPELLINGS, TABLE

#: Methods that convert each element on its own (a dtype or device change).
_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type_as"})
_RESHAPES = frozenset({"reshape", "view"})


def repeated_rows(graph: fx.Graph, shadows: dict, state: list) -> list:
    """Trace rewrite: rows repeated block by block, and the elementwise ops over them, over
    ``[blocks, tokens, ...]`` (this module); ``shadows`` gets the new nodes' values. Changes
    nothing the report lists."""
    for node in list(graph.nodes):
        if node.graph is not graph:
            continue  # erased by an earlier rewrite
        found = _repeated(node, shadows)
        if found is not None:
            blocks, tokens = found
            members = _elementwise_readers(node, blocks, tokens, shadows)
            if members:
                _rewrite(graph, shadows, node, members, blocks, tokens)
    graph.lint()
    return []


def _repeated(node: fx.Node, shadows: dict) -> tuple[int, tuple[int, int]] | None:
    """(E, the token count at each traced size) where ``node`` is ``x.repeat(E, 1, ..., 1)`` of
    an ``x`` whose dim 0 follows the tokens; None otherwise."""
    if node.op != "call_method" or node.target != "repeat" or not node.args:
        return None
    if _written(node.args[0], shadows):
        return None  # the repeat is a copy of x at one point of the program
    x, out = _pair(shadows, node.args[0]), _pair(shadows, node)
    if x is None or out is None or x[0].dim() != out[0].dim() or not x[0].dim():
        return None
    tokens = (x[0].shape[0], x[1].shape[0])
    if tokens[0] == tokens[1] or x[0].shape[1:] != x[1].shape[1:] or any(t < 1 for t in tokens):
        return None  # its dim 0 does not follow the tokens
    blocks = out[0].shape[0] // tokens[0]
    if blocks < 2 or any(o.shape != (blocks * t, *x[0].shape[1:]) for o, t in zip(out, tokens)):
        return None  # not E whole copies of the rows alone
    return blocks, tokens


def _written(node, shadows: dict) -> bool:
    """Is ``node``'s tensor written in place anywhere in the graph, through any view of it?"""
    value = _pair(shadows, node)
    if value is None:
        return True
    memory = value[0].untyped_storage().data_ptr()
    for holder in node.graph.nodes:
        held = _pair(shadows, holder)
        if held is not None and held[0].untyped_storage().data_ptr() == memory:
            if any(writes_into(user, holder) for user in holder.users):
                return True
    return False


def _elementwise_readers(seed: fx.Node, blocks: int, tokens: tuple, shadows: dict) -> list[fx.Node]:
    """The elementwise ops over ``seed``'s rows, and over theirs, in graph order, that can run
    over ``[E, T, ...]``; empty where one would need eager's layout kept and cannot have it."""
    members: set[fx.Node] = set()
    frontier = [seed]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in members and _takes_in(user, members | {seed}, blocks, tokens, shadows):
                members.add(user)
                frontier.append(user)
    ordered = [n for n in seed.graph.nodes if n in members]
    for node in ordered:
        read_outside = any(u not in members for u in node.users)
        if read_outside and not all(v.is_contiguous() for v in _pair(shadows, node)):
            return []
    return ordered


def _takes_in(node: fx.Node, inside: set, blocks: int, tokens: tuple, shadows: dict) -> bool:
    """Whether ``node`` is an elementwise op whose result has ``[E·T, ...]`` rows and whose
    tensor operands can each be read over ``[E, T, ...]`` (module docstring)."""
    if not _is_elementwise(node):
        return False
    out = _pair(shadows, node)
    if out is None or not _rows_of_blocks(out, blocks, tokens):
        return False
    for operand in _tensor_operands(node):
        value = _pair(shadows, operand)
        if value is None:
            return False
        if operand in inside or _rows_of_blocks(value, blocks, tokens):
            continue
        if value[0].shape != value[1].shape or not _broadcasts_along_rows(value[0], out[0]):
            return False
    return True


def _is_elementwise(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    name = op_name(node)
    if node.op == "call_method" and name in _CASTS:
        return True
    entry = TABLE.get(SPELLINGS.get(name, name))
    return entry is not None and entry.kind == POINTWISE and not name.endswith("_")


def _rows_of_blocks(value: tuple, blocks: int, tokens: tuple) -> bool:
    """``[E·T, ...]`` at both traced sizes, the same past dim 0."""
    return all(v.dim() and v.shape[0] == blocks * t for v, t in zip(value, tokens)) and value[0].shape[1:] == value[1].shape[1:]


def _broadcasts_along_rows(value: torch.Tensor, out: torch.Tensor) -> bool:
    """Read alike by every row of ``out``: of a lower rank, or one row."""
    return value.dim() < out.dim() or (value.dim() == out.dim() and value.shape[0] == 1)


def _tensor_operands(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _pair(shadows: dict, node) -> tuple | None:
    value = shadows.get(node.name) if isinstance(node, fx.Node) else None
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, torch.Tensor) for v in value):
        return value
    return None


def _rewrite(graph: fx.Graph, shadows: dict, seed: fx.Node, members: list, blocks: int, tokens: tuple) -> None:
    """Each member again over ``[E, T, ...]`` (with its values at both traced sizes), what reads
    one outside them given it back as ``[E·T, ...]``; the members, and the repeat where nothing
    else reads it, erased."""
    split: dict[fx.Node, fx.Node] = {}

    def add(op: str, target, args: tuple, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
        node = graph.create_node(op, target, args, kwargs or {})
        node.meta = dict(like.meta)
        run = (lambda a, *rest, **k: getattr(a, target)(*rest, **k)) if op == "call_method" else target
        shadows[node.name] = tuple(
            run(*fx.node.map_arg(args, lambda a, at=at: shadows[a.name][at]),
                **fx.node.map_arg(kwargs or {}, lambda a, at=at: shadows[a.name][at]))
            for at in (0, 1)
        )  # fmt: skip
        return node

    def over_blocks(operand: fx.Node, reader: fx.Node) -> fx.Node:
        if operand not in split:
            if operand is seed:  # x.repeat(E, 1, ...) is x broadcast over a new dim
                rank = shadows[operand.name][0].dim()
                split[operand] = add("call_method", "expand", (operand.args[0], blocks, *(-1,) * rank), reader)
            else:
                rest = tuple(shadows[operand.name][0].shape[1:])
                source = _source_of_blocks(operand, blocks, tokens, shadows)
                split[operand] = add("call_method", "reshape", (source, blocks, -1, *rest), reader)
        return split[operand]

    def operand(a: fx.Node, reader: fx.Node) -> fx.Node:
        value = _pair(shadows, a)
        if a in split or a is seed or (value is not None and _rows_of_blocks(value, blocks, tokens)):
            return over_blocks(a, reader)
        return a

    for node in members:
        with graph.inserting_before(node):
            args = fx.node.map_arg(node.args, lambda a, node=node: operand(a, node))
            kwargs = fx.node.map_arg(node.kwargs, lambda a, node=node: operand(a, node))
            split[node] = add(node.op, node.target, args, node, kwargs)
    made_back: list[fx.Node] = []
    for node in members:
        outside = [u for u in node.users if u not in members]
        if outside:
            rest = tuple(shadows[node.name][0].shape[1:])
            with graph.inserting_after(split[node]):
                dense = add("call_method", "contiguous", (split[node],), node)
            made_back.append(dense)
            with graph.inserting_after(dense):
                back = add("call_method", "view", (dense, -1, *rest), node)
            for user in outside:
                user.replace_input_with(node, back)
    read = {a for node in members for a in _tensor_operands(node)} - set(members)
    for node in reversed(members):
        graph.erase_node(node)
    erased = sum(_erase_unread(graph, node, shadows) for node in read if node.graph is graph)
    # The report counts eager's launches: the copies erased (the repeat, a reshape that copied)
    # stand in the first copy made back to [E·T, ...] (where there are more of those than
    # copies erased, eager's count comes out that much higher).
    if made_back:
        made_back[0].meta[FOLDED_LAUNCHES] = max(0, erased - len(made_back))


def _source_of_blocks(node: fx.Node, blocks: int, tokens: tuple, shadows: dict) -> fx.Node:
    """What ``node``'s ``[E, T, ...]`` form is a reshape of: the ``[E, T, ...]`` tensor it
    reshapes (``scores.transpose(0, 1).reshape(-1, 1)``: the transposed scores, read as a
    view), else ``node`` itself."""
    if node.op == "call_method" and node.target in _RESHAPES and node.args:
        source = _pair(shadows, node.args[0])
        if (
            source is not None and all(s.dim() >= 2 and tuple(s.shape[:2]) == (blocks, t) for s, t in zip(source, tokens))
            and not _written(node.args[0], shadows)
        ):  # fmt: skip
            return node.args[0]
    return node


#: Calls with no effect but their value: erased once nothing reads them.
_PURE = frozenset({"repeat", "reshape", "view", "transpose", "contiguous", "expand", "getitem", "getattr", "size"})


def _erase_unread(graph: fx.Graph, node: fx.Node, shadows: dict) -> int:
    """``node`` erased where it is a pure call nothing reads (the repeat; the scores' reshape,
    now read through its source), then what only it read (``E`` read off the scores' shape):
    the kernels eager launched for them (a copy each)."""
    if node.users or node.op not in ("call_function", "call_method") or op_name(node) not in _PURE:
        return 0
    reads = _tensor_operands(node)
    copied = _copies(node, shadows)
    graph.erase_node(node)
    return copied + sum(_erase_unread(graph, read, shadows) for read in reads)


def _copies(node: fx.Node, shadows: dict) -> int:
    """1 where eager's ``node`` wrote a new tensor (a repeat, a reshape that could not view)."""
    out, source = _pair(shadows, node), _pair(shadows, node.args[0]) if node.args else None
    if out is None or source is None:
        return 0
    return int(out[0].untyped_storage().data_ptr() != source[0].untyped_storage().data_ptr())
