"""Programmatic dependent launch (`gr_plugin.ops.triton.pdl`): every kernel of the cached step's
chain (append, paged attention, the split parts' sum, the two norms) launched with ``launch_pdl``
waits for the kernel before it before reading or writing anything.

Checked on the compiled code, without a GPU: each kernel, with the arguments its launcher passes,
is compiled for a Hopper target (PTX) with ``PDL`` on and off. The GPU tests (tests/gpu) check the
results of the launches themselves, PDL on against off.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gr_plugin.ops import triton as tri_ops

_COMPILE = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from gr_plugin.ops.triton import append_kv as ap, hstu_attention as tri, layer_norm as ln
from tests.ops.test_triton_attention import build

launches = []


def spy(kernel):
    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((kernel, args, kw))
    return Spy()


for mod, name in ((tri, "_hstu_fwd"), (tri, "_sum_parts"), (ap, "_append"), (ln, "_ln_mul"), (ln, "_add_ln")):
    setattr(mod, name, spy(getattr(mod, name)))
_, p = build([37, 0, 90], [3, 2, 1], [20, 0, 64], 64, 2, 16, torch.float32, "cpu")
q, k, v, kv = (p[n].to(torch.bfloat16) for n in ("q", "k", "v", "kv_layer"))
rest = [p[n] for n in ("kv_indices", "kv_indptr", "history_lengths", "q_offsets", "new_lengths")]
tri.paged_hstu_attention(q, k, v, kv, *rest, alpha=0.3, n_norm=16.0, max_q_len=p["max_q_len"],
                         max_history_len=p["max_history_len"], num_history_tokens=0, num_splits=2)
ap.append_kv(kv, k, v, torch.tensor([3, 9]), torch.tensor([0, 4]))
a, u = q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1)
w, b = torch.ones(a.shape[1], dtype=torch.bfloat16), torch.zeros(a.shape[1], dtype=torch.bfloat16)
ln.layer_norm_mul(a, w, b, 1e-5, u)
ln.add_layer_norm(a, u, w, b, 1e-5)


class Hopper:  # what Triton's compiler asks a driver (no GPU here)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
found = []
for kernel, args, kw in launches:
    bound = {**dict(zip(kernel.arg_names, args)), **kw}
    row = {"kernel": kernel.__name__, "launch_pdl": kw.get("launch_pdl", False), "PDL": kw["PDL"]}
    for on in (True, False):
        sig, consts = {}, {}
        for param, name in zip(kernel.params, kernel.arg_names):
            if param.is_constexpr:
                sig[name], consts[name] = "constexpr", bound[name]
            else:
                sig[name] = mangle_type(bound[name])
        consts["PDL"] = on
        c = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=Hopper().get_current_target(),
                           options={"launch_pdl": on, "num_warps": kw.get("num_warps", 4)})
        body = c.asm["ptx"][c.asm["ptx"].find(".entry"):]
        first = {op: body.find(op) for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                               "ld.global", "st.global", "ret;")}
        row["on" if on else "off"] = {"launch_pdl": c.metadata.launch_pdl, **first}
    found.append(row)
json.dump(found, sys.stdout)
"""


def test_each_kernel_waits_for_the_one_before_it_first():
    """Compiled with ``PDL`` (Hopper PTX): the wait on the kernel before (``griddepcontrol.wait``)
    comes before the program's first global load, store and return, and the early trigger of the
    next kernel right after it; compiled without: neither instruction. The launchers pass ``PDL``
    off, and no ``launch_pdl``, for CPU tensors (the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert [r["kernel"] for r in rows] == ["_hstu_fwd", "_sum_parts", "_append", "_ln_mul", "_add_ln"]
    for r in rows:
        assert r["PDL"] is False and r["launch_pdl"] is False, r  # CPU tensors: plain launches
        on, off = r["on"], r["off"]
        assert on["launch_pdl"] is True and off["launch_pdl"] is False, r
        wait = on["griddepcontrol.wait"]
        assert 0 <= wait < on["griddepcontrol.launch_dependents"], r
        for op in ("ld.global", "st.global", "ret;"):
            assert on[op] == -1 or wait < on[op], (r["kernel"], op, on)
        assert off["griddepcontrol.wait"] == -1 and off["griddepcontrol.launch_dependents"] == -1, r


def test_pdl_is_off_for_cpu_tensors_and_by_the_setting(monkeypatch):
    """`pdl` asks for programmatic dependent launch only on CUDA (Hopper or newer), and
    ``GR_PLUGIN_PDL=0`` (the module's ``PDL``) turns it off everywhere."""
    t = torch.zeros(1)
    assert tri_ops.pdl(t) is False and tri_ops.pdl_options(t) == {"PDL": False}
    if not torch.cuda.is_available():
        pytest.skip("the CUDA branch needs a GPU")
    c = torch.zeros(1, device="cuda")
    assert tri_ops.pdl(c) is (torch.cuda.get_device_capability()[0] >= 9)
    monkeypatch.setattr(tri_ops, "PDL", False)
    assert tri_ops.pdl(c) is False and tri_ops.pdl_options(c) == {"PDL": False}


def _capture(fn):
    """``fn`` captured into a CUDA graph (after a warm-up on a side stream): a replay returning its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return lambda: (g.replay(), out)[1]


@pytest.mark.gpu
def test_pdl_launches_compute_what_plain_launches_compute(monkeypatch):
    """The cached step (append, split paged attention, parts' sum, fused norms; 2 layers) and the
    full pass, eager and captured into CUDA graphs, with programmatic dependent launch on and off:
    the same bits. Before every run the pages the step appends to are overwritten with noise, so an
    attention that read them before the append landed would differ."""
    from gr_plugin.bench.block import Block

    blk = Block(128, 128, num_layers=2, hidden=512, heads=4, num_pages=64)
    users = [0, 1]
    blk.fill(users, 896)
    plan = blk.plan(users, 1024)
    pages = torch.unique(plan.metadata.new_token_slots // 128)  # the new tokens' pages hold only them
    assert pages.numel() == 2
    cached, _ = blk.cached_fn(plan, 2, 128, 64)
    full, _ = blk.full_fn(2, 1024, 64)
    g = torch.Generator(device="cuda").manual_seed(0)

    def scribbled(fn):
        blk.cache.kv_table[:, pages] = torch.randn(blk.cache.kv_table[:, pages].shape, generator=g, device="cuda")
        return fn().clone()

    outs = {}
    with torch.no_grad():
        for on in (False, True):
            monkeypatch.setattr(tri_ops, "PDL", on)
            outs[on, "eager"] = [scribbled(cached) for _ in range(3)] + [full().clone()]
            graphs = _capture(cached), _capture(full)
            outs[on, "graph"] = [scribbled(graphs[0]) for _ in range(20)] + [graphs[1]().clone()]
    want_cached, want_full = outs[False, "eager"][0], outs[False, "eager"][-1]
    assert torch.isfinite(want_cached).all() and torch.isfinite(want_full).all()
    for key, got in outs.items():
        for t in got[:-1]:
            assert torch.equal(t, want_cached), key
        assert torch.equal(got[-1], want_full), key
    blk.cache.abort(plan)
