"""A warp-specialised, ping-pong form of the paged attention's main loop, compiled for the H200 (sm_90)
here, without a GPU: what the compiler makes of it before any device time is spent on it.

python scripts/ws_pingpong_compile.py [regs] [head_dim] [block_n] [stages] -> the register split the
compiler emits (``setmaxnreg`` per partition), the kernel's warps and shared memory, its warpgroup
MMAs and barriers.

The kernel is a skeleton of the form FlashAttention-3 uses on Hopper (arXiv 2407.08608, section 3.1:
warp specialisation, and two consumer warpgroups taking turns so one's SiLU runs under the other's
MMAs), in Gluon (`gl.warp_specialize`, Triton 3.6): one producer warp issues the TMA loads of a ring of
key / value blocks (``ready`` / ``empty`` mbarriers, both consumers free a stage); two 4-warp consumer
partitions each hold 64 query rows of a 128-row tile and take turns issuing their MMAs through two
``turn`` mbarriers (Gluon 3.6 exposes no named barriers). It has full blocks only: no paging, masked
tail, candidate self term, norm gate or key splits (`gr_plugin.ops.triton.hstu_gluon._paged_fwd` has
them), and it has not run on a GPU. The published gain of this form over pipelining within one
warpgroup (what `_paged_fwd` does) is about 16% at head_dim 128 (the paper's Table 2: 570 -> 661
TFLOP/s), and FlashAttention-3 does not take turns at head_dim 256.
"""

from __future__ import annotations

import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

from gr_plugin.ops.triton.hstu_gluon import _silu

V_ROWS = gl.constexpr(4096)  # the values' rows follow the keys' in the one tensor the descriptor covers


@gluon.jit
def _producer(QD, KD, q_bufs, k_bufs, v_bufs, q_bar, ready, empty, n_blocks, m0, STAGES: gl.constexpr):
    """One warp: both consumers' query rows, then each key / value block once its stage is free."""
    BN: gl.constexpr = KD.block_type.shape[0]
    for c in gl.static_range(2):
        mbarrier.expect(q_bar.index(c), QD.block_type.nbytes)
        tma.async_copy_global_to_shared(QD, [m0 + c * 64, 0], q_bar.index(c), q_bufs.index(c))
    for i in range(n_blocks):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # (the first round passes: no consumer yet)
        mbarrier.expect(ready.index(s), 2 * KD.block_type.nbytes)
        tma.async_copy_global_to_shared(KD, [i * BN, 0], ready.index(s), k_bufs.index(s))
        tma.async_copy_global_to_shared(KD, [i * BN + V_ROWS, 0], ready.index(s), v_bufs.index(s))


@gluon.jit
def _consumer(Out, q_bufs, k_bufs, v_bufs, q_bar, ready, empty, turn, n_blocks, m0, alpha, C: gl.constexpr,
              STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warpgroup, 64 query rows: per block, wait for its turn, issue the next block's q k^T and this
    block's p v, hand the turn over, then the SiLU while the other warpgroup's MMAs run."""
    nw: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_smem = q_bufs.index(C)
    if C == 1:
        mbarrier.arrive(turn.index(0))  # consumer 0 issues first
    mbarrier.wait(q_bar.index(C), 0)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(turn.index(C), 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - C))
    s = warpgroup_mma_wait(0, deps=(s, ))
    p = gl.convert_layout(_silu(s, alpha).to(gl.bfloat16), p_layout)
    for j in range(0, n_blocks - 1):
        st = (j + 1) % STAGES
        mbarrier.wait(ready.index(st), ((j + 1) // STAGES) & 1)
        mbarrier.wait(turn.index(C), (j + 1) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_bufs.index(j % STAGES), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - C))
        s = warpgroup_mma_wait(1, deps=(s, ))
        p = gl.convert_layout(_silu(s, alpha).to(gl.bfloat16), p_layout)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index(j % STAGES))
    last = (n_blocks - 1) % STAGES
    acc = warpgroup_mma(p, v_bufs.index(last), acc)
    mbarrier.arrive(empty.index(last))
    rows = m0 + C * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(Out + rows[:, None] * HEAD_DIM + cols[None, :], acc)


@gluon.jit
def _kernel(QD, KD, Out, n_blocks, alpha, STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
            REGS: gl.constexpr, num_warps: gl.constexpr):
    m0 = gl.program_id(0) * 128
    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, HEAD_DIM], QD.layout)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KD.layout)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KD.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers free a stage
    fence_async_shared()
    gl.warp_specialize([  # (the first, a consumer, is the default partition: ``num_warps`` warps)
        (_consumer, (Out, q_bufs, k_bufs, v_bufs, q_bar, ready, empty, turn, n_blocks, m0, alpha, 0, STAGES,
                     HEAD_DIM, BLOCK_N)),
        (_consumer, (Out, q_bufs, k_bufs, v_bufs, q_bar, ready, empty, turn, n_blocks, m0, alpha, 1, STAGES,
                     HEAD_DIM, BLOCK_N)),
        (_producer, (QD, KD, q_bufs, k_bufs, v_bufs, q_bar, ready, empty, n_blocks, m0, STAGES)),
    ], [4, 1], [REGS, 24])


def compile_for_h200(regs: int = 240, dim: int = 128, block_n: int = 64, stages: int = 2):
    """The kernel compiled for sm_90: Triton's compiled-kernel object (``asm``, ``metadata``)."""
    t = torch.empty(2 * V_ROWS.value, dim, dtype=torch.bfloat16)
    kd = TensorDescriptor.from_tensor(t, [block_n, dim], gl.NVMMASharedLayout.get_default_for([block_n, dim],
                                                                                              gl.bfloat16))
    qd = TensorDescriptor.from_tensor(t, [64, dim], gl.NVMMASharedLayout.get_default_for([64, dim], gl.bfloat16))
    sig = {"QD": mangle_type(qd), "KD": mangle_type(kd), "Out": "*fp32", "n_blocks": "i32", "alpha": "fp32",
           "STAGES": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "REGS": "constexpr",
           "num_warps": "constexpr"}
    src = GluonASTSource(_kernel, sig, constexprs={"STAGES": stages, "HEAD_DIM": dim, "BLOCK_N": block_n,
                                                    "REGS": regs, "num_warps": 4})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def main(argv: list[str]) -> None:
    regs, dim, block_n, stages = ([int(a) for a in argv] + [240, 128, 64, 2][len(argv):])[:4]
    k = compile_for_h200(regs, dim, block_n, stages)
    ptx = k.asm["ptx"]
    print(f"head_dim {dim}, BLOCK_N {block_n}, {stages} stages, consumer registers asked {regs}:")
    print("  setmaxnreg, in the order emitted:",
          [" ".join(m) for m in re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)])
    print("  threads:", re.findall(r"\.reqntid \d+", ptx), "kernel maxnreg:", re.findall(r"\.maxnreg \d+", ptx))
    print(f"  shared memory {k.metadata.shared} bytes, warpgroup MMAs {len(re.findall(r'wgmma.mma_async', ptx))}")


if __name__ == "__main__":
    main(sys.argv[1:])
