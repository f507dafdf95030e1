"""fuser.install.decode_attention: the decode attention kernel against a float64 reference of
``F.scaled_dot_product_attention`` over odd and realistic shapes (groups of query heads, key
counts of one and several slices, head dims), each mask kind and each dtype, with per-dtype
tolerances; blocks a mask hides are not read; the calls it does not take run PyTorch's."""

import pytest
import torch
import torch.nn.functional as F
import triton

from fuser.install import decode_attention
from fuser.install.decode_attention import attention, slices, takes

# atol, rtol: scores and the softmax in fp32, the probabilities rounded to the dtype before their
# product with the values (as flash and cuDNN round them), the output rounded once
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = list(TOLERANCES)
# (batch, query heads, key heads, keys, head dim)
SHAPES = [(1, 8, 2, 37, 16), (2, 4, 4, 200, 64), (1, 6, 2, 1000, 80), (3, 7, 1, 130, 96), (1, 32, 8, 256, 64), (1, 4, 1, 2100, 32)]


def reference(q, k, v, mask=None, scale=None):
    """sdpa in float64, each query head against its group's key head."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores + (torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask.double())
    return (scores.softmax(-1) @ v).to(q.dtype)


def inputs(batch, heads, heads_kv, keys, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    k = torch.randn(batch, heads_kv, keys, dim, generator=g).to(dtype)
    v = torch.randn(batch, heads_kv, keys, dim, generator=g).to(dtype)
    return q, k, v


def static_cache_mask(batch, keys, written, dtype, fill=float("-inf")):
    """An additive mask of a static cache: each sequence's first ``written[b]`` keys seen, the rest ``fill``."""
    mask = torch.full((batch, 1, 1, keys), fill, dtype=torch.float32)
    for b, n in enumerate(written):
        mask[b, ..., :n] = 0.0
    return mask.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("batch,heads,heads_kv,keys,dim", SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "additive", "boolean", "per head"])
def test_the_kernel_is_sdpa_at_one_query_row(dtype, batch, heads, heads_kv, keys, dim, mask_kind):
    q, k, v = inputs(batch, heads, heads_kv, keys, dim, dtype, seed=keys + dim)
    g = torch.Generator().manual_seed(1)
    mask = {
        "none": None,
        "additive": static_cache_mask(batch, keys, [max(1, keys - 3 * b) for b in range(batch)], dtype),
        "boolean": torch.rand(batch, 1, 1, keys, generator=g) > 0.3,
        "per head": (torch.randn(batch, heads, 1, keys, generator=g) * 2).to(dtype),
    }[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[..., 0] = True  # every head sees a key
    assert takes(q, k, v, mask, enable_gqa=heads != heads_kv)
    got = attention(q, k, v, mask, enable_gqa=heads != heads_kv)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, reference(q, k, v, mask), atol=atol, rtol=rtol)
    assert got.shape == q.shape and got.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_scale_and_a_mask_of_fewer_dims_are_sdpa_s(dtype):
    q, k, v = inputs(2, 4, 2, 90, 32, dtype)
    mask = static_cache_mask(1, 90, [70], dtype)[0, 0]  # [1, keys]: broadcast over batch and heads
    atol, rtol = TOLERANCES[dtype]
    got = attention(q, k, v, mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, reference(q, k, v, mask, scale=0.3), atol=atol, rtol=rtol)


def test_the_slices_give_about_four_programs_an_sm_each_of_whole_blocks():
    assert slices(1, 8, 256, 64) == 4  # 4 blocks of 64 keys: a slice each
    assert slices(1, 8, 4096, 64) == 64  # 64 blocks: one each (528 // 8 is 66)
    assert slices(1, 8, 16384, 64) == 66  # 528 // 8
    assert slices(64, 8, 4096, 64) == 1  # 512 programs already
    assert slices(1, 1, 10, 64) == 1


def test_wider_heads_aim_at_fewer_programs():
    assert slices(1, 8, 16384, 32) == 66  # no more than at 64 wide
    assert slices(1, 8, 16384, 128) == 33  # 264 // 8
    assert slices(1, 8, 16384, 256) == 16  # 132 // 8
    assert slices(1, 8, 256, 128) == 4  # the blocks, still


@pytest.mark.parametrize("mask_kind", ["none", "additive", "boolean"])
def test_a_slice_of_several_blocks_and_a_part_is_sdpa(monkeypatch, mask_kind):
    # Two programs over 200 keys: slices of 128 and 72, each two blocks, the last a part (its
    # keys past the slice hidden, whatever the mask of the block before said).
    monkeypatch.setattr(decode_attention, "PROGRAMS", 2)
    dtype = torch.float32
    q, k, v = inputs(1, 4, 1, 200, 32, dtype, seed=7)
    assert slices(1, 1, 200, 32) == 2
    g = torch.Generator().manual_seed(2)
    mask = {"none": None, "additive": static_cache_mask(1, 200, [190], dtype),
            "boolean": torch.rand(1, 1, 1, 200, generator=g) > 0.3}[mask_kind]  # fmt: skip
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(attention(q, k, v, mask, enable_gqa=True), reference(q, k, v, mask), atol=atol, rtol=rtol)


@pytest.mark.parametrize("fill", [float("-inf"), -65504.0, "finfo.min"])
def test_blocks_the_mask_hides_are_not_read(monkeypatch, fill):
    # A static cache of 1000 rows, 70 and 130 written: rows past them hold NaN. Read, they would
    # make the output NaN (a NaN score, or 0 × NaN); hidden blocks are skipped, and the output is
    # attention over the written rows alone. A block of -inf is skipped by any program; one of a
    # large negative fill only by a program all of whose heads have seen a key (one slice here:
    # a slice of hidden keys alone reads them, as it cannot tell whether any other slice sees one).
    dtype = torch.bfloat16
    if fill != float("-inf"):
        monkeypatch.setattr(decode_attention, "PROGRAMS", 1)
    fill = torch.finfo(dtype).min if fill == "finfo.min" else fill
    q, k, v = inputs(2, 8, 2, 1000, 64, dtype)
    written = [70, 130]
    mask = static_cache_mask(2, 1000, written, dtype, fill)
    for b, n in enumerate(written):
        k[b, :, (n + 63) // 64 * 64 :] = float("nan")  # from the first block wholly past the written rows
        v[b, :, (n + 63) // 64 * 64 :] = float("nan")
    got = attention(q, k, v, mask, enable_gqa=True)
    atol, rtol = TOLERANCES[dtype]
    for b, n in enumerate(written):
        expected = reference(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        torch.testing.assert_close(got[b : b + 1], expected, atol=atol, rtol=rtol)


def write_case(batch, heads, heads_kv, keys, dim, dtype, slot):
    """A static cache of ``keys`` rows with ``slot`` written before the step, the step's new key
    and value rows (views of a [batch, 1, heads, dim] projection, as transformers makes them),
    the mask (rows up to the slot seen) and what the cache holds after the write."""
    q, k, v = inputs(batch, heads, heads_kv, keys, dim, dtype, seed=slot)
    g = torch.Generator().manual_seed(slot + 1)
    new_k, new_v = (torch.randn(batch, 1, heads_kv, dim, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    mask = static_cache_mask(batch, keys, [slot + 1] * batch, dtype)
    k_after, v_after = k.clone(), v.clone()
    if slot < keys:  # one past the cache: dropped
        k_after[:, :, slot], v_after[:, :, slot] = new_k[:, :, 0], new_v[:, :, 0]
    return q, k, v, new_k, new_v, mask, k_after, v_after


WRITES = [(torch.bfloat16, shape, slot) for shape in [(1, 8, 2, 37, 16), (2, 4, 4, 200, 64), (1, 4, 1, 2100, 32)]
          for slot in sorted({0, 63, 64, shape[3] // 2, shape[3] - 1, shape[3]})] + [
          (dtype, (1, 32, 8, 256, 64), 100) for dtype in DTYPES]  # fmt: skip


# the same, the slices combined in the kernel: a slot at the start, the middle and past the end
WRITES_COMBINED = [(torch.bfloat16, shape, slot, True) for shape in [(1, 8, 2, 37, 16), (2, 4, 4, 200, 64), (1, 4, 1, 2100, 32)]
                   for slot in (0, shape[3] // 2, shape[3])]  # fmt: skip


@pytest.mark.parametrize("dtype,shape,slot,combine", [(*w, False) for w in WRITES] + WRITES_COMBINED,
                         ids=lambda x: str(x).removeprefix("torch."))  # fmt: skip
def test_the_kernel_writes_the_step_s_rows_at_the_length_then_attends(monkeypatch, dtype, shape, slot, combine):
    # The step's rows written at the cache's length (one slice holds that slot, a slice's first
    # and last rows among them; one past the cache drops them), attention over the cache as
    # written, the length moved on by one and the count of programs back at zero; given counts,
    # one launch, the counts back at zero.
    batch, heads, heads_kv, keys, dim = shape
    q, k, v, new_k, new_v, mask, k_after, v_after = write_case(batch, heads, heads_kv, keys, dim, dtype, slot)
    length, done = torch.tensor([slot]), torch.zeros(1, dtype=torch.int32)
    counts = torch.zeros(batch * heads_kv, dtype=torch.int32) if combine else None
    combines = spy_combines(monkeypatch)
    assert decode_attention.takes_write(k, v, new_k, new_v, length, done)
    got = attention(q, k, v, mask, enable_gqa=True, write=(new_k, new_v, length, done), counts=counts)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, reference(q, k_after, v_after, mask), atol=atol, rtol=rtol)
    assert torch.equal(k, k_after) and torch.equal(v, v_after)
    assert length.tolist() == [slot + 1] and done.tolist() == [0]
    sliced = slices(batch, heads_kv, keys, dim) > 1
    assert len(combines) == (sliced and not combine), combines
    if combine:
        assert counts.tolist() == [0] * batch * heads_kv


def spy_combines(monkeypatch) -> list:
    """Each launch of the combining kernel, as its grid."""
    launches, real = [], decode_attention._combine_launch

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(decode_attention, "_combine_launch", Spy())
    return launches


# (batch, query heads, key heads, keys, head dim): slices more than one read at a time, a group of
# more rows than the smallest tile, heads of 256
COMBINED = [(1, 32, 8, 256, 64), (2, 4, 4, 200, 64), (1, 6, 2, 1000, 80), (1, 4, 1, 2100, 32), (3, 7, 1, 130, 96),
            (1, 64, 2, 900, 128), (2, 8, 4, 520, 256)]  # fmt: skip


@pytest.mark.parametrize("dtype,batch,heads,heads_kv,keys,dim", [(torch.float32, *shape) for shape in COMBINED]
                         + [(dtype, *shape) for dtype in (torch.float16, torch.bfloat16) for shape in COMBINED[:2]],
                         ids=lambda x: str(x).removeprefix("torch."))  # fmt: skip
def test_slices_combined_in_the_kernel_are_sdpa(monkeypatch, dtype, batch, heads, heads_kv, keys, dim):
    # The last of a key head's slices to finish combines them: no second kernel, the counts
    # back at zero, called again the same (a call after a call).
    q, k, v = inputs(batch, heads, heads_kv, keys, dim, dtype, seed=keys)
    mask = static_cache_mask(batch, keys, [max(1, keys - 40 * b) for b in range(batch)], dtype)
    counts = torch.zeros(batch * heads_kv + 3, dtype=torch.int32)  # more than needed serve
    combines = spy_combines(monkeypatch)
    atol, rtol = TOLERANCES[dtype]
    expected = reference(q, k, v, mask)
    for _ in range(2):
        torch.testing.assert_close(attention(q, k, v, mask, enable_gqa=True, counts=counts), expected, atol=atol, rtol=rtol)
        assert counts.tolist() == [0] * len(counts)
    assert combines == []


def test_the_combined_cases_read_their_slices_in_one_fold_and_in_several():
    folds = [triton.cdiv(slices(b, hk, keys, d), decode_attention.fold(max(16, triton.next_power_of_2(h // hk)), max(16, d)))
             for b, h, hk, keys, d in COMBINED]  # fmt: skip
    assert 1 in folds and max(folds) > 1, folds


def test_counts_it_cannot_use_are_refused():
    q, k, v = inputs(2, 8, 2, 300, 32, torch.float32)
    for what, counts in {"too few": torch.zeros(3, dtype=torch.int32), "int64": torch.zeros(4, dtype=torch.int64),
                         "not contiguous": torch.zeros(8, dtype=torch.int32)[::2]}.items():  # fmt: skip
        with pytest.raises(ValueError, match="counts of"):
            attention(q, k, v, enable_gqa=True, counts=counts)
        assert not decode_attention.takes_counts(counts, 2, 2, q.device), what


def test_a_write_it_cannot_make_is_refused():
    q, k, v, new_k, new_v, mask, _, _ = write_case(1, 8, 2, 37, 16, torch.float32, 5)
    length, done = torch.tensor([5]), torch.zeros(1, dtype=torch.int32)
    cannot = {
        "two new rows": dict(new_k=torch.cat([new_k, new_k], dim=2)),
        "new rows of another dtype": dict(new_v=new_v.half()),
        "a float length": dict(length=length.float()),
        "a count of another dtype": dict(done=done.long()),
    }
    for what, change in cannot.items():
        assert not decode_attention.takes_write(**(dict(k=k, v=v, new_k=new_k, new_v=new_v, length=length, done=done) | change)), what
    with pytest.raises(ValueError, match="does not take"):
        attention(q, k, v, mask, is_causal=True, enable_gqa=True, write=(new_k, new_v, length, done))
    assert length.tolist() == [5]  # nothing written


def test_a_head_that_sees_no_key_attends_as_pytorch_s_does():
    # Filled with -65504 everywhere (cuDNN's fill), a sequence sees no key: sdpa's softmax then
    # runs over all the keys' scores, each 65504 below zero; the kernel reads every block for it.
    dtype = torch.float32
    q, k, v = inputs(2, 4, 2, 300, 32, dtype)
    mask = static_cache_mask(2, 300, [0, 100], dtype, fill=-65504.0)
    got = attention(q, k, v, mask, enable_gqa=True)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), atol=1e-5, rtol=1e-5)
    assert got.isfinite().all()


def test_calls_it_does_not_take_run_pytorch_s(monkeypatch):
    launches = []
    monkeypatch.setattr(decode_attention, "_attend_launch", type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **k: launches.append(k)})())
    q, k, v = inputs(1, 4, 2, 50, 16, torch.float32)
    refused = {
        "two query rows": dict(q=torch.cat([q, q], dim=2)),
        "dropout": dict(dropout_p=0.1),
        "causal": dict(is_causal=True),
        "heads not grouped without enable_gqa": dict(enable_gqa=False),
        "a half query": dict(q=q.half()),
        "an additive mask of another dtype": dict(attn_mask=torch.zeros(1, 1, 1, 50, dtype=torch.float16)),
        "a mask of several query rows": dict(attn_mask=torch.zeros(1, 1, 2, 50)),
        "a mask of another key count": dict(attn_mask=torch.zeros(1, 1, 1, 49)),
        "a head dim past 256": dict(q=torch.randn(1, 4, 1, 272), k=torch.randn(1, 2, 50, 272), v=torch.randn(1, 2, 50, 272)),
        "key heads that do not divide the query heads": dict(k=k[:, :1].expand(1, 3, 50, 16), v=v[:, :1].expand(1, 3, 50, 16)),
    }
    for what, change in refused.items():
        call = dict(q=q, k=k, v=v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=True) | change
        assert not takes(**call), what
    for what in ("two query rows", "causal", "a head dim past 256"):  # calls PyTorch's runs: its result, unchanged
        call = dict(q=q, k=k, v=v, enable_gqa=True) | refused[what]
        q_, k_, v_ = call.pop("q"), call.pop("k"), call.pop("v")
        assert torch.equal(attention(q_, k_, v_, **call), F.scaled_dot_product_attention(q_, k_, v_, **call)), what
    assert launches == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("batch,heads,heads_kv,keys,dim", [(1, 32, 8, 256, 64), (8, 32, 8, 4096, 128), (3, 7, 1, 130, 96), (2, 64, 8, 1000, 128)])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_compiled_kernel_is_sdpa_at_one_query_row(dtype, batch, heads, heads_kv, keys, dim, pdl):
    q, k, v = (t.cuda() for t in inputs(batch, heads, heads_kv, keys, dim, dtype, seed=keys))
    mask = static_cache_mask(batch, keys, [max(1, keys // 2 - b) for b in range(batch)], dtype, fill=-65504.0).cuda()
    atol, rtol = TOLERANCES[dtype]
    expected = reference(q.cpu(), k.cpu(), v.cpu(), mask.cpu()).cuda()
    for _ in range(2):  # Triton's dispatch, then the binary's own launcher
        got = attention(q, k, v, mask, enable_gqa=True, pdl=pdl and torch.cuda.get_device_capability() >= (9, 0))
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, sdpa, atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape,slot", [((1, 32, 8, 256, 64), 0), ((1, 32, 8, 256, 64), 130), ((1, 32, 8, 4096, 128), 2047),
                                        ((1, 4, 1, 2100, 32), 2099), ((1, 4, 1, 2100, 32), 2100)])  # fmt: skip
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("combine", [False, True], ids=["combined apart", "combined in it"])
def test_compiled_kernel_writes_the_step_s_rows_then_attends(dtype, shape, slot, pdl, combine):
    # Compiled, the program that writes the new rows reads them from its registers, not from the
    # memory its other threads wrote: the result is attention over the cache as written. Combined
    # in the kernel, the last program of a key head reads the slices other programs wrote.
    case = write_case(*shape, dtype, slot)
    q, k, v, new_k, new_v, mask, k_after, v_after = (t.cuda() for t in case)
    atol, rtol = TOLERANCES[dtype]
    pdl = pdl and torch.cuda.get_device_capability() >= (9, 0)
    counts = torch.zeros(shape[0] * shape[2], dtype=torch.int32, device="cuda") if combine else None
    for _ in range(2):  # Triton's dispatch, then the binary's own launcher
        length, done = torch.tensor([slot], device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
        got = attention(q, k, v, mask, enable_gqa=True, pdl=pdl, write=(new_k, new_v, length, done), counts=counts)
        torch.testing.assert_close(got, reference(q.cpu(), k_after.cpu(), v_after.cpu(), mask.cpu()).cuda(), atol=atol, rtol=rtol)
        assert torch.equal(k, k_after) and torch.equal(v, v_after)
        assert length.tolist() == [slot + 1] and done.tolist() == [0]
        assert counts is None or counts.tolist() == [0] * len(counts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("batch,heads,heads_kv,keys,dim", COMBINED + [(1, 32, 8, 16384, 64), (1, 32, 8, 4096, 128)])
def test_compiled_kernel_combines_its_slices_in_a_captured_graph(dtype, batch, heads, heads_kv, keys, dim):
    # Replayed in a CUDA graph on new inputs, many times: a combine that read a slice before its
    # program had stored it, or counts not set back, would differ from the reference.
    q, k, v = (t.cuda() for t in inputs(batch, heads, heads_kv, keys, dim, dtype, seed=keys))
    mask = static_cache_mask(batch, keys, [max(1, keys - 40 * b) for b in range(batch)], dtype, fill=-65504.0).cuda()
    counts = torch.zeros(batch * heads_kv, dtype=torch.int32, device="cuda")
    pdl = torch.cuda.get_device_capability() >= (9, 0)
    attention(q, k, v, mask, enable_gqa=True, pdl=pdl, counts=counts)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, mask, enable_gqa=True, pdl=pdl, counts=counts)
    atol, rtol = TOLERANCES[dtype]
    g = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(20):
        q.copy_(torch.randn(q.shape, device="cuda", generator=g))
        v.copy_(torch.randn(v.shape, device="cuda", generator=g))
        graph.replay()
        torch.testing.assert_close(out, reference(q.cpu(), k.cpu(), v.cpu(), mask.cpu()).cuda(), atol=atol, rtol=rtol)
    assert counts.tolist() == [0] * len(counts)


def test_a_cache_that_grows_launches_the_same_binaries(monkeypatch):
    # A dynamic cache grows a key a step: the kernels' constants (what Triton compiles a binary
    # for) must not follow the key count, or decode would compile as it goes.
    constants = []
    for name in ("_attend_launch", "_combine_launch"):
        monkeypatch.setattr(decode_attention, name, type("Spy", (), {"__getitem__": lambda self, grid: lambda *a, **k: constants.append(
            tuple(sorted((key, v) for key, v in k.items() if key.isupper())))})())  # fmt: skip
    for keys in (130, 300, 700, 1000):
        q, k, v = inputs(1, 8, 2, keys, 64, torch.bfloat16)
        attention(q, k, v, static_cache_mask(1, keys, [keys - 5], torch.bfloat16), enable_gqa=True)
    assert len(constants) == 8 and len(set(constants)) == 2, set(constants)  # one of each kernel
