"""mHC post: R'[t, i] = post[t, i] * out[t] + sum_j comb[t, j, i] * R[t, j], fp32, one rounding
(DSV4.md D and H; sglang post_torch_impl, mhc_post_tilelang)."""

from fuser.pattern import tensor


def reference(out, R, post, comb):
    mixed = (comb.unsqueeze(-1) * R.unsqueeze(2)).sum(1)
    return (post.unsqueeze(-1) * out.unsqueeze(1) + mixed).to(out.dtype)


PATTERN = dict(
    template="row_reduce",
    inputs=dict(
        out=tensor("T, H", "bfloat16 float16 float32"),
        R=tensor("T, n, H", "bfloat16 float16 float32"),
        post=tensor("T, n", "float32"),
        comb=tensor("T, n, n", "float32"),
    ),
    example=dict(n=4, H=64),
)
