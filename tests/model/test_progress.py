"""fuser.apply says what it does while it fuses a model: a record on the ``fuser`` logger per
layer structure and per other module, with the seconds it took; and a warning about a fused
module names the user's line, not fuser's."""

import logging
import re
import warnings

import torch

import fuser
from tests.install.test_once_per_forward import Stack, inputs
from tests.install.test_reliability import ScaledProjection, randn


def test_apply_on_a_model_logs_each_layer_structure_with_its_time(caplog):
    model = Stack()
    with caplog.at_level(logging.INFO, logger="fuser"):
        fuser.apply(model, inputs(0))
    lines = [r.getMessage() for r in caplog.records if r.name == "fuser"]
    fused = [line for line in lines if "Layer layers fused" in line]
    assert len(fused) == 1, lines  # one structure: its three layers
    assert re.fullmatch(r"fuser: Stack: 3 Layer layers fused, \d+ -> \d+ glue launches each \(\d+\.\d s\)", fused[0])
    assert re.fullmatch(r"fuser: Stack: done \(\d+\.\d s\)", lines[-1]), lines


def test_a_warning_about_a_fused_module_names_the_line_that_called_it():
    m, x = ScaledProjection(), randn(4, 32)
    fuser.apply(m, (x,))
    m.norm.variance_epsilon = 0.5
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        m(x)  # THE-CALL
    (warning,) = [w for w in caught if "variance_epsilon" in str(w.message)]
    line = next(i for i, s in enumerate(open(__file__), 1) if s.rstrip().endswith("# THE-CALL"))
    assert (warning.filename, warning.lineno) == (__file__, line)
