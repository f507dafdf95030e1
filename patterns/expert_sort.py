"""Expert-offset preparation of grouped-GEMM MoE: the token-expert pairs sorted by expert, the
permutation and the cumulative per-expert counts, one launch (transformers' grouped_mm experts;
vLLM's moe_align_block_size is the same counting sort).

``expert_ids`` holds the T * k routed expert ids of a step. The kernel sorts them stably (equal
ids keep their order by position), which is one of the orders ``torch.sort(stable=False)`` may
give: an unstable sort leaves only the order among equal ids open, and the MoE layer does not
depend on it (the rows are gathered by ``perm`` and put back by its inverse). Validation
compares the permutation up to that freedom. ``histc`` counts the ids 0 .. bins-1 each in its
own bin and drops the ids outside that range (expert parallelism's sentinels); it takes its
input as float32 on the CPU and MPS and as int32 elsewhere, as transformers writes it, so the
reference does the same and the kernel counts what that cast gives.

Where the layer puts its rows back in token order with the inverse permutation
(``inv[perm] = arange(S)``, :func:`fuser.trace.in_place_idioms.inverse_permutation`), the kernel writes that
too: it is where each id goes, which the sort computes anyway. ``inverse`` is 1 for a layer
that builds it and 0 for one that does not.
"""

import torch

from fuser.trace.in_place_idioms import inverse_permutation
from fuser.pattern import Param, tensor

#: Most experts the kernel counts: up to here histc's float32 bin arithmetic puts every id in
#: its own bin exactly.
MAX_EXPERTS = 1024


def reference(expert_ids, bins=Param(8), top=Param(7), inverse=Param(1, search=(0, 1))):
    sorted_ids, perm = torch.sort(expert_ids)
    counted = sorted_ids.float() if sorted_ids.device.type in ("cpu", "mps") else sorted_ids.int()
    counts = torch.histc(counted, bins=bins, min=0, max=top)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    if inverse:
        return sorted_ids, perm, offsets, inverse_permutation(perm)
    return sorted_ids, perm, offsets


PATTERN = dict(
    template="expert_sort",
    inputs=dict(expert_ids=tensor("T", "int64")),
    outputs=("sorted_ids", "perm", "offsets", "inverse"),
    constraint=lambda bins, top: top == bins - 1 and 1 <= bins <= MAX_EXPERTS,
)
