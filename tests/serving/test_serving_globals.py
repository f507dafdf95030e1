"""Engine-wide flags that traced code calls (sglang's ``get_is_capture_mode()``) are read as
guarded values (:class:`fuser.serving.global_reads.GlobalReads`): the trace takes the branch the flag
gave, and a call where the flag returns something else runs the module's own code, not the
fused graph baked with the old value. A flag the trace never read guards nothing."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from fuser.serving import lazy_fusion as serving
from fuser.serving.options import Options
from fuser.serving.targets import EngineFacts
from fuser.install.splice import STATE_ATTR
from serving_helpers import FusedGraphRuns, decode_mode

FLAGS = {"capture": False, "unread": False}


def capture_mode() -> bool:
    """Stands in for sglang's ``get_is_capture_mode()``: a module-level function of a flag."""
    return FLAGS["capture"]


def unread_flag() -> bool:
    return FLAGS["unread"]


def scale_tensor() -> torch.Tensor:
    return torch.ones(())


class Block(nn.Module):
    """Branches on an engine flag, as ``DeepseekV2MoE.forward`` does on capture mode."""

    def forward(self, x):
        if capture_mode():
            return (x * 2).sigmoid() * 3
        return (x * 2).sigmoid() + 1


class ReadsATensor(nn.Module):
    def forward(self, x):
        return (x * scale_tensor()).sigmoid() + 1


def facts(*paths: str) -> EngineFacts:
    return EngineFacts(is_leaf=lambda m: False, searched=lambda m: False,
                       global_reads=tuple(f"{__name__}.{p}" for p in paths))


def decode_call(module, x):
    with decode_mode():
        return module(x)


@pytest.fixture(autouse=True)
def flags_off():
    FLAGS.update(capture=False, unread=False)
    yield
    FLAGS.update(capture=False, unread=False)


def test_a_flag_read_by_the_trace_is_guarded_and_a_call_where_it_differs_runs_the_original_code():
    block = Block()
    target = serving.LazyFusion("block", block, Options(), facts("capture_mode", "unread_flag"))
    x = torch.randn(5, 32)
    with torch.no_grad():
        first = decode_call(block, x)
        assert target.state == "fused"
        assert target.globals.read() == {f"{__name__}.capture_mode()": False}  # unread_flag was never called
        runs = FusedGraphRuns(target)
        torch.testing.assert_close(decode_call(block, x), (x * 2).sigmoid() + 1)
        assert runs.count == 1
        FLAGS["capture"] = True  # the engine enters capture mode
        torch.testing.assert_close(decode_call(block, x), (x * 2).sigmoid() * 3)  # the module's own branch
        assert runs.count == 1
        FLAGS["capture"] = False
        FLAGS["unread"] = True  # a flag the trace did not read: the fused graph still runs
        decode_call(block, x)
        assert runs.count == 2
    torch.testing.assert_close(first, (x * 2).sigmoid() + 1)


def test_the_flag_functions_are_their_own_again_after_the_fusion():
    original = capture_mode
    block = Block()
    serving.LazyFusion("block", block, Options(), facts("capture_mode"))
    with torch.no_grad():
        decode_call(block, torch.randn(3, 32))
    assert globals()["capture_mode"] is original


def test_a_flag_returning_a_tensor_cannot_be_guarded_and_the_module_stays_eager(caplog):
    module = ReadsATensor()
    target = serving.LazyFusion("reads", module, Options(), facts("scale_tensor"))
    x = torch.randn(3, 32)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fuser"):
        out = decode_call(module, x)
    assert target.state == "eager"
    assert STATE_ATTR not in module.__dict__ and "forward" not in module.__dict__
    torch.testing.assert_close(out, (x * scale_tensor()).sigmoid() + 1)
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("fuser: reads left eager:") and "scale_tensor() returned Tensor" in message


def test_a_flag_outside_the_mode_is_not_consulted():
    block = Block()
    target = serving.LazyFusion("block", block, Options(), facts("capture_mode"))
    x = torch.randn(4, 32)
    with torch.no_grad():
        decode_call(block, x)
        runs = FusedGraphRuns(target)
        torch.testing.assert_close(block(x), (x * 2).sigmoid() + 1)  # no mode: the module's own code
    assert runs.count == 0
