"""merged_weights: linear layers that read one input, run as one GEMM on their weights
concatenated once (q, k and v; gate and up; the down-projections of a query and a key).

When a module is fused, the weights of each group (and their biases) are concatenated into one
tensor, held in a plain attribute of the module (``_fuser_merged_<first layer>``), and each
layer's own parameter becomes a view of its rows. The ``Parameter`` objects stay what they were,
so ``state_dict``, ``load_state_dict``, ``named_parameters`` and a copy of the module see the
same parameters, and no memory is added: a write into a parameter (``load_state_dict``,
``copy_``) is a write into the merged tensor. A parameter assigned anew (``layer.weight =
...``, a move to another device) no longer views it: the guard sees that at the next call and
merges again (inside a CUDA-graph capture, where nothing may be allocated, that call runs the
module's own forward). After ``fuser.restore`` the parameters remain views of the tensor, which
they keep alive: the same values, in the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuser.codegen.capture_guard import capturing

MERGED_PREFIX = "_fuser_merged_"
VIEWS_ATTR = MERGED_PREFIX + "views"


@dataclass(frozen=True)
class Group:
    """One merged GEMM: its layers (qualified ``nn.Linear`` names, in the order of their rows)
    and the attributes that hold the merged weight and bias (None: the layers have no bias)."""

    layers: tuple[str, ...]
    weight: str
    bias: str | None

    @classmethod
    def of(cls, layers: tuple[str, ...], biased: bool) -> "Group":
        stem = MERGED_PREFIX + layers[0].replace(".", "_")
        return cls(layers, stem + "_weight", stem + "_bias" if biased else None)

    def attributes(self) -> tuple[str, ...]:
        return (self.weight,) + ((self.bias,) if self.bias else ())


@dataclass(frozen=True)
class MergedWeights:
    """The groups of a plan: what :func:`merge` does on each module the plan is installed on."""

    groups: tuple[Group, ...]

    def attributes(self) -> tuple[str, ...]:
        return tuple(a for g in self.groups for a in g.attributes())

    def merge(self, module: torch.nn.Module) -> None:
        """Concatenate each group's weights (and biases) into the module's attributes and make
        the layers' parameters views of them."""
        views = []  # (layer, "weight" or "bias", where its rows start): what current() checks
        with torch.no_grad():
            for group in self.groups:
                layers = [module.get_submodule(name) for name in group.layers]
                for kind, attribute in (("weight", group.weight), ("bias", group.bias)):
                    if attribute is None:
                        continue
                    params = [getattr(layer, kind) for layer in layers]
                    merged = torch.cat([p.detach() for p in params], dim=0)
                    object.__setattr__(module, attribute, merged)
                    for layer, param, rows in zip(layers, params, merged.split([p.shape[0] for p in params], dim=0)):
                        param.data = rows
                        views.append((layer, kind, rows.data_ptr()))
        module.__dict__[VIEWS_ATTR] = views

    def current(self, module: torch.nn.Module) -> bool:
        """True when every layer's parameters still view their rows of the merged tensors
        (merging again first where one was assigned anew); False when they do not and cannot
        be merged now (inside a CUDA-graph capture) or no longer fit the fused graph."""
        views = module.__dict__.get(VIEWS_ATTR)
        if views and all(getattr(layer, kind).data_ptr() == at for layer, kind, at in views):
            return True
        if capturing() or not all(_same_shapes(module, group) for group in self.groups):
            return False
        self.merge(module)
        return True

    def remove(self, module: torch.nn.Module) -> None:
        for attribute in (*self.attributes(), VIEWS_ATTR):
            module.__dict__.pop(attribute, None)


def _same_shapes(module: torch.nn.Module, group: Group) -> bool:
    """Do the layers' weights still make the merged tensor the fused graph slices?"""
    merged = module.__dict__.get(group.weight)
    weights = [module.get_submodule(name).weight for name in group.layers]
    return (
        merged is not None
        and sum(w.shape[0] for w in weights) == merged.shape[0]
        and all(w.shape[1:] == merged.shape[1:] and w.dtype == merged.dtype and w.device == merged.device for w in weights)
    )
