"""Tidying a lowered body (fuser.lower.tidy): dead assignments out, comments that repeat a name out,
repeated blocks rolled into loops that compute what the straight lines computed."""

import math

import pytest

from fuser.lower.tidy import MIN_REPEATS, live, rolled, tidy, without_echo


def test_an_assignment_nothing_reads_is_dropped_and_the_rest_kept():
    lines = [
        "a = tl.load(p)",
        "b = a * 2",
        "dead = tl.reshape(b, (2, 2))",
        "for _pick in tl.static_range(2):",
        "    a = a + b",
        "tl.store(q, a)",
    ]
    assert live(lines) == lines[:2] + lines[3:]


def test_a_name_passed_as_a_keyword_is_not_a_read():
    lines = ["mask = x > 0", "mask0 = y > 0", "tl.store(q, y, mask=mask0)"]
    assert live(lines) == lines[1:]


def test_a_comment_that_repeats_the_name_is_dropped():
    assert without_echo("add_1 = a + b  # add_1") == "add_1 = a + b"
    assert without_echo("x_re, x_im = tl.split(x)  # view_as_complex") == "x_re, x_im = tl.split(x)  # view_as_complex"


def sinkhorn_lines(iterations: int, then: str = "out = {last} * 2.0") -> list[str]:
    """Straight-line Sinkhorn normalisations as the lowerer writes them: each iteration sums
    over one axis, adds eps and divides, reading the previous iteration's result."""
    lines, previous = ["x = tl.load(p)", "start = x + 1e-06"], "start"
    for it in range(iterations):
        axis = it % 2
        lines += [
            f"sum_{it} = tl.expand_dims(tl.sum({previous}, axis={axis}), {axis})",
            f"add_{it} = sum_{it} + 1e-06",
            f"div_{it} = {previous} / add_{it}",
        ]
        previous = f"div_{it}"
    return lines + [then.format(last=previous), "tl.store(q, out)"]


def run(lines: list[str]) -> dict:
    """Execute a body with `tl` standing in for math on scalars (sum over any axis of a scalar
    is the scalar): the values every name ends with."""

    class Tl:
        @staticmethod
        def load(p):
            return p

        @staticmethod
        def sum(x, axis):
            return x

        @staticmethod
        def expand_dims(x, axis):
            return x

        @staticmethod
        def static_range(n):
            return range(n)

        @staticmethod
        def store(q, value):
            q.append(value)

    stored = []
    scope = {"tl": Tl, "p": 3.0, "q": stored, "math": math}
    exec("\n".join(lines), scope)
    return stored


def test_twenty_normalisations_become_one_loop_of_two_that_computes_the_same():
    straight = sinkhorn_lines(20)
    loop = rolled(straight)
    assert sum(line.startswith("for _repeat in tl.static_range(10):") for line in loop) == 1, "\n".join(loop)
    assert len(loop) < len(straight) - 40
    assert run(loop) == run(straight)


def test_the_result_of_the_last_repeat_is_read_after_the_loop_by_the_loops_name():
    loop = rolled(sinkhorn_lines(6, then="out = {last} * 2.0 + add_5"))
    assert "out = div_1 * 2.0 + add_1" in loop, "\n".join(loop)
    assert run(loop) == run(sinkhorn_lines(6, then="out = {last} * 2.0 + add_5"))


def test_a_value_of_an_earlier_repeat_read_after_the_run_keeps_the_lines_straight():
    straight = sinkhorn_lines(6, then="out = {last} + div_0")
    assert rolled(straight) == straight


@pytest.mark.parametrize("iterations", [1, MIN_REPEATS * 2 - 1])
def test_too_few_repeats_stay_straight(iterations):
    straight = sinkhorn_lines(iterations)
    assert rolled(straight) == straight


def test_repeats_that_do_not_read_each_other_stay_straight():
    """Independent copies of one computation are different values, not a loop."""
    lines = ["a = x * 0.5", "b = x * 0.5", "c = x * 0.5", "d = x * 0.5", "out = a + b + c + d"]
    assert rolled(lines) == lines


def test_a_repeat_that_reads_its_input_after_writing_the_next_value_stays_straight():
    lines = ["s0 = x"]
    for i in range(1, 5):
        lines += [f"s{i} = s{i - 1} * 2.0", f"t{i} = s{i} + s{i - 1}"]
    assert rolled(lines) == lines


def test_tidy_keeps_every_stored_value():
    straight = sinkhorn_lines(20)
    assert run(tidy(straight)) == run(straight)
