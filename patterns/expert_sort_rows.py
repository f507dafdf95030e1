"""Expert-offset preparation of grouped-GEMM MoE with the gather of each pair's hidden row, one
launch: the pairs sorted by expert, the permutation, the cumulative per-expert counts (as
``expert_sort``) and ``hidden[perm // k]``, the rows the first expert GEMM reads (transformers'
grouped_mm experts, ``selected_hidden_states_g``).

The sort kernel knows where each pair goes, so it copies the pair's token row there itself
instead of a second kernel reading the permutation back. The rows follow the sort's order of
equal ids as the permutation does, and validation compares them up to that order too.
"""

import torch

from fuser.trace.in_place_idioms import inverse_permutation
from fuser.pattern import Param, tensor

#: Most experts the kernel counts (as ``expert_sort``).
MAX_EXPERTS = 1024


def reference(expert_ids, hidden, bins=Param(8), top=Param(7), k=Param(2), inverse=Param(1, search=(0, 1))):
    sorted_ids, perm = torch.sort(expert_ids)
    rows = hidden[perm // k]
    counted = sorted_ids.float() if sorted_ids.device.type in ("cpu", "mps") else sorted_ids.int()
    counts = torch.histc(counted, bins=bins, min=0, max=top)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    if inverse:
        return sorted_ids, perm, offsets, rows, inverse_permutation(perm)
    return sorted_ids, perm, offsets, rows


PATTERN = dict(
    template="expert_sort",
    inputs=dict(expert_ids=tensor("T", "int64"), hidden=tensor("T, N", "bfloat16 float16 float32")),
    outputs=("sorted_ids", "perm", "offsets", "rows", "inverse"),  # inverse last: a layer may not build it
    example=dict(N=64),
    constraint=lambda bins, top, k: top == bins - 1 and 1 <= bins <= MAX_EXPERTS and k >= 1,
)
