"""The rule the attention kernels' autograd functions share (`gr_plugin.ops.cpu_attention`,
`gr_plugin.ops.triton.hstu_attention_bwd`): their backward is a kernel, not differentiable itself.

Asked for a graph of it (``create_graph=True``: a double backward, a gradient penalty, a torch.func
transform) a backward raises rather than return gradients that silently lack their dependence on q, k, v;
the torch reference (``GR_PLUGIN_ATTENTION=reference``) has the higher-order gradients. Imports only torch.
"""

from __future__ import annotations

import torch


def refuse_second_order(kernels: str) -> None:
    """Raise where autograd records the running backward (grad mode is on in a backward only for
    ``create_graph=True``); ``kernels`` names the backward ("the C++", "the Triton")."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{kernels} HSTU attention's backward is not differentiable (create_graph=True: a "
                           "double backward, or a torch.func transform): run the attention through the torch "
                           "reference (GR_PLUGIN_ATTENTION=reference) for those")
