"""Where the Gluon attention kernel's ``silu_inputs`` form spends its time (an experiment, on the GPU).

python3 scripts/gpu/probe_silu_variants.py [DIM,PAGE,BS ...] -> graphed µs (the norm gate included,
min over interleaved rounds) of the package's paged launch on the Gluon kernel with activated inputs
(``silu_inputs=False``) and with the projection before its SiLU (``silu_inputs=True``), and of
variants of `gr_plugin.ops.triton.hstu_gluon` made by text substitutions of its source (each one
part of the ``SILU_IN`` form taken away), at the block's shapes (4096 history, 128 new + 256
candidates, 4 heads). The variants are timing probes only: some give wrong values on purpose.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gluon_attention import _case, _gate, _graphed_best

from gr_plugin.ops.triton import hstu_attention as tri
from gr_plugin.ops.triton import hstu_gluon

SELF_KEY = "                            SILU_IN)\n            w +="
SELF_VALUE = "mask=cand_v[:, None], other=0.0), SILU_IN)"
Q_ACT = "q_smem.slice(c * CH, CH, dim=1).store(_activated(qc, True))"
Q_CHUNKED = "    if SILU_IN:  # the query tile activated"
Q_WHOLE = "        q_smem = gl.allocate_shared_memory(dt, [BLOCK_M, HEAD_DIM], q_sl, q)\n"

VARIANTS = {  # label -> substitutions of the package's source
    "no self-term SiLU": [(SELF_KEY, "                            False)\n            w +="),
                          (SELF_VALUE, "mask=cand_v[:, None], other=0.0), False)")],
    "query chunks stored without SiLU, no self-term SiLU": [
        (Q_ACT, "q_smem.slice(c * CH, CH, dim=1).store(qc)"),
        (SELF_KEY, "                            False)\n            w +="),
        (SELF_VALUE, "mask=cand_v[:, None], other=0.0), False)")],
    "whole query tile activated in registers": [
        (Q_CHUNKED, "    if False:  # the query tile activated"),
        (Q_WHOLE, "        q = _activated(q, SILU_IN)\n" + Q_WHOLE)],
}


def variant(label: str, subs) -> object:
    src = open(hstu_gluon.__file__).read()
    for old, new in subs:
        if old not in src:
            raise SystemExit(f"variant {label!r}: {old!r} is not in the kernel's source")
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), f"gluon_variant_{abs(hash(label))}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(cases) -> None:
    package_launch = hstu_gluon.launch
    mods = {label: variant(label, subs) for label, subs in VARIANTS.items()}
    for dim, page, bs in cases:
        args, max_q, max_kv = _case(bs, 4096, dim, page)
        gate = _gate(dim, args[0].shape[0])

        def fn(launch, silu):
            def run():
                hstu_gluon.launch = launch  # (read by `_launch` when the graph is captured)
                try:
                    return tri._launch(*args, 0.1, 4096.0, max_q, paged=True, max_kv_len=max_kv, norm_gate=gate,
                                       kernel="gluon", silu_inputs=silu)
                finally:
                    hstu_gluon.launch = package_launch
            return run

        fns = {"activated inputs (silu_inputs=False)": fn(package_launch, False),
               "silu_inputs=True, the package's kernel": fn(package_launch, True)}
        for label, mod in mods.items():
            fns[f"silu_inputs=True, {label}"] = fn(mod.launch, True)
        best = _graphed_best(fns, 3)
        print(f"d{dim} p{page} bs{bs} (graphed µs, with the norm gate, min of 3 rounds):")
        for label, ms in best.items():
            print(f"   {ms * 1000:8.2f}  {label}")


if __name__ == "__main__":
    cases = [tuple(int(x) for x in c.split(",")) for c in sys.argv[1:]] or [(256, 32, 1), (128, 128, 1), (128, 128, 8)]
    with torch.no_grad():
        main(cases)
