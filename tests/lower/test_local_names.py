"""How the lowerer names a kernel's locals: after the graph node (``v_`` before a name taken or
the frame's), or after a pattern's reference, numbered where one name stands for several values."""

from fuser.lower.code import free_name, without_node_echo


def test_a_node_name_taken_gets_the_v_prefix():
    assert free_name("add_1", set()) == "add_1"
    assert free_name("add_1", {"add_1"}) == "v_add_1"
    assert free_name("row", set()) == "v_row"


def test_a_reference_name_taken_is_numbered():
    assert free_name("xf", set(), numbered=True) == "xf"
    assert free_name("xf", {"xf"}, numbered=True) == "xf_1"
    assert free_name("xf", {"xf", "xf_1"}, numbered=True) == "xf_2"


def test_a_reference_name_of_the_frame_or_a_builtin_is_never_used_as_it_is():
    assert free_name("row", set(), numbered=True) == "v_row"
    assert free_name("row", {"v_row"}, numbered=True) == "v_row_1"
    assert free_name("mask0", set(), numbered=True) == "v_mask0"
    assert free_name("max", set(), numbered=True) == "v_max"
    assert free_name("_s", set(), numbered=True) == "v__s"


def test_a_companion_of_a_taken_name_blocks_it():
    assert free_name("x", {"x_re"}, numbered=True) == "x_1"


def test_the_comment_naming_the_node_a_renamed_local_holds_goes():
    lines = ["g = to_bf16(x)  # clamp", "clamp_1 = y  # clamp_1", "h = z  # other", "a_re, a_im = p, q  # a"]
    assert without_node_echo(lines, {"clamp": "g", "a": "a"}) == [
        "g = to_bf16(x)", "clamp_1 = y  # clamp_1", "h = z  # other", "a_re, a_im = p, q  # a",
    ]  # fmt: skip
