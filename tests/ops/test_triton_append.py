"""The Triton append against the reference: bit for bit (interpreter on CPU, the kernel on GPU)."""

import pytest
import torch

from gr_plugin.cache import paged_ops
from gr_plugin.ops.triton.append_kv import append_kv


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("heads", "dim", "page"), [(2, 8, 4), (4, 128, 128), (3, 16, 32)])
def test_matches_reference(device, heads, dim, page):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    g = torch.Generator().manual_seed(heads * dim)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    table = torch.randn(7, 2, page, heads, dim, generator=g).to(dtype=dtype, device=device)
    want = table.clone()
    k = torch.randn(11, heads, dim, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(11, heads, dim, generator=g).to(dtype=dtype, device=device)
    rows = torch.tensor([0, 3, 4, 9, 10], device=device)
    slots = torch.tensor([2, page, page + 1, 5 * page + page - 1, 3], device=device)
    append_kv(table, k, v, slots, rows)
    paged_ops.append_kv(want, k, v, slots, rows)
    assert torch.equal(table, want)


_WRITES = """
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from gr_plugin.ops.triton import append_kv as mod


class Hopper:  # what Triton's TTIR generation asks a driver (no GPU here)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

launches = []


def spy(kernel):
    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                kw = {k: a for k, a in kw.items() if k not in ("num_warps", "num_stages")}
                launches.append((kernel, {**dict(zip(kernel.arg_names, args)), **kw}))
            return launch
    return Spy()


mod._append, mod._silu_append = spy(mod._append), spy(mod._silu_append)
for dtype in (torch.float32, torch.bfloat16):
    table = torch.zeros(5, 2, 4, 2, 8, dtype=dtype)
    x = torch.randn(9, 4, 2, 8).to(dtype)
    q, k, v = x[:, 0], x[:, 1], x[:, 2]
    slots, rows = torch.tensor([1, 2]), torch.tensor([0, 3])
    mod.append_kv(table, k, v, slots, rows)
    mod.append_kv(torch.stack([table, table]), k, v, slots, rows, layer=1)
    mod.silu_append_kv(table, q, k, v, slots, rows)
writes = [sorted(d.name for d in identify_accessed_tensors(kernel, a, {}).read_writes.writes) for kernel, a in launches]
print(json.dumps([[kernel.fn.__name__, w] for (kernel, _), w in zip(launches, writes)]))
"""


def test_inductor_sees_the_append_kernels_write_only_their_outputs():
    """What a traced launch (AOTInductor's compile of the custom op) learns from Inductor's analysis of
    the kernels' TTIR (generated for a Hopper target; no GPU needed): the append writes the table and
    nothing else, the SiLU form the table and its new buffer. Were ``K`` or ``V`` among the writes, a
    package would copy them at every layer (a store through a helper's results did that to the
    attention: `hstu_attention._tile`'s NOTE); a shared helper for the two must keep this."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _WRITES], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [["_append", ["KV"]], ["_append", ["KV"]], ["_silu_append", ["KV", "Out"]]] * 2
