"""The lowering registry and the op table agree: every lowering an entry names is registered,
the registry holds nothing the table does not name, and an entry whose lowering is missing
fails with an error that names the op."""

import dataclasses

import pytest

from fuser.ir import ops
from fuser.lower import lowerer  # noqa: F401 (imports every family module, which registers its lowerings)
from fuser.lower.registry import LOWERINGS, UnknownLowering, lowering, lowering_for


def test_every_lowering_the_table_names_is_registered():
    named = {op.lowering for op in ops.TABLE.values() if op.lowering}
    missing = sorted(named - set(LOWERINGS))
    assert not missing, f"lowerings named in fuser/ir/ops.py that no module under fuser/lower/ registers: {missing}"


def test_the_registry_names_nothing_the_table_lacks():
    named = {op.lowering for op in ops.TABLE.values() if op.lowering}
    unused = sorted(set(LOWERINGS) - named)
    assert not unused, f"lowerings no op-table entry names: {unused}"


def test_every_table_op_has_an_expression_or_a_lowering():
    """A pointwise entry with an expression (float or integer) needs no lowering; any other
    names one that exists."""
    for name, op in ops.TABLE.items():
        if op.kind == ops.POINTWISE and (op.triton or op.integer):
            continue
        assert lowering_for(op), name


def test_a_missing_lowering_raises_an_error_naming_the_op():
    entry = dataclasses.replace(ops.TABLE["layer_norm"], name="group_norm", lowering="group_norm")
    with pytest.raises(UnknownLowering, match="'group_norm'.*fuser/ir/ops.py"):
        lowering_for(entry)
    nameless = dataclasses.replace(ops.TABLE["softmax"], name="sparsemax", lowering=None)
    with pytest.raises(UnknownLowering, match="'sparsemax' names no lowering"):
        lowering_for(nameless)


def test_a_lowering_registered_twice_is_refused():
    with pytest.raises(ValueError, match="two lowerings called 'layer_norm'"):
        lowering("layer_norm")(lambda lw, node, cop: None)
    assert LOWERINGS["layer_norm"].__module__ == "fuser.lower.normalizations"
