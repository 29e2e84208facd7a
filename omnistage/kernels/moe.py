"""A sparse MoE layer's experts as two grouped GEMMs (Triton, on CUDA), with the routing and the token sorting on
the device: no host sync and shapes fixed by the token count, so a decode step with MoE layers can be captured
in a CUDA graph.

- `route`: softmax top-k of the router's logits (softmax in float32, optionally renormalized over the top k,
  weights rounded to the logits' dtype), as transformers' Qwen MoE routers compute it.
- `align`: the T * k (token, expert) assignments sorted by expert into blocks of `block_m` slots, each block of
  one expert (its last block padded with a sentinel). The slot count is a bound fixed by T, k and the expert
  count (at most min(T * k, experts) experts are hit, each wasting under one block), so nothing is read back.
- `fused_experts`: kernel 1 takes a block's token rows against its expert's gate and up rows and stores
  silu(gate) * up per slot; kernel 2 takes those against the expert's down rows, scales each slot by its routing
  weight and stores it at its assignment; the k assignments of a token are then summed in float32. Blocks past
  the ones used exit at once. Rounding follows transformers' expert loop (each linear's result, the activation,
  the product and the weighted output rounded to the activations' dtype); only the top-k sum is exact before
  its one rounding, where the loop adds expert by expert in the activations' dtype.

`experts_reference` is the same math in torch, per expert (CPU, and what the kernels are tested against).
Triton's interpreter (CPU tests) computes bfloat16 dots wrongly and truncates float32 to bfloat16, so there
(`WIDEN`) the kernels' tiles are widened to float32 before `tl.dot` (exact products, as the tensor cores') and
roundings to bfloat16 go to nearest even on the bits first; everything else runs as on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from omnistage import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is needed only on CUDA
    triton = None


def available(device: torch.device) -> bool:
    """Whether `fused_experts` runs its kernels on `device` (CUDA, with Triton); elsewhere it runs in torch."""
    return triton is not None and device.type == "cuda"


def _use_triton(x: torch.Tensor) -> bool:
    return available(x.device)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


@dataclass(frozen=True)
class Alignment:
    """Assignments (token * k + j) sorted by expert into single-expert blocks of `block_m` slots."""

    slots: torch.Tensor  # [S] int32: the assignment in each slot; T * k (the sentinel) in padding slots
    block_expert: torch.Tensor  # [S / block_m] int32: each block's expert; the expert count past the used blocks
    block_m: int


def max_slots(assignments: int, num_experts: int, block_m: int) -> int:
    """Slots enough for any routing of `assignments`: each hit expert pads its last block by under block_m."""
    hit = min(assignments, num_experts)
    return -(-(assignments + hit * (block_m - 1)) // block_m) * block_m


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the assignments of `ids` [T, k] by expert (stable: by token within an expert), each expert's run padded
    to whole blocks. Device ops only; every size follows from T, k, the expert count and block_m."""
    flat = ids.reshape(-1)
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts  # each expert's first position among the sorted assignments
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    dest = (padded_end - padded)[expert] + torch.arange(n, device=device) - start[expert]
    size = max_slots(n, num_experts, block_m)
    slots = torch.full((size,), n, dtype=torch.int32, device=device).scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return Alignment(slots, block_expert, block_m)


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down[e](silu(gate[e] x) * up[e] x) for e = ids[t, j], in torch, one expert at a time
    (rounded as `fused_experts`). x [T, H], gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I]."""
    t, k = ids.shape
    inter = down.shape[-1]
    out = x.new_zeros(t * k, x.shape[1])
    flat = ids.reshape(-1)
    for e in flat.unique().tolist():  # a host sync: the plain path
        rows = (flat == e).nonzero()[:, 0]
        gu = F.linear(x[rows // k], gate_up[e])
        y = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down[e])
        out[rows] = y * weights.reshape(-1)[rows, None]
    return out.view(t, k, -1).sum(1, dtype=torch.float32).to(x.dtype)


@dataclass(frozen=True)
class Tiling:
    block_m: int  # slots per block
    block_n: int  # output features per program
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter


def choose_tiling(assignments: int, num_experts: int, n: int, elem_bytes: int = 2, sms: int = 132) -> Tiling:
    """Tiles from the shapes alone (a captured graph stays valid). While experts get under 32 rows each on average
    (decode: the GEMMs only stream weights): 16-slot blocks, tiles of 64 output features (32 where there would be
    fewer programs than SMs) and 16 KB of weights per tile and pipeline stage. Past that: 64-slot blocks, 128
    features, 128 bytes of K, 8 warps. Untuned defaults: no sweep on a GPU yet."""
    per_expert = assignments / num_experts
    if per_expert < 32:
        block_m = 16
        blocks = max_slots(assignments, num_experts, block_m) // block_m
        block_n = 64 if blocks * triton.cdiv(n, 64) >= sms else 32
        return Tiling(block_m, block_n, 16384 // (block_n * elem_bytes), num_warps=4, num_stages=3)
    return Tiling(64, 128, 128 // elem_bytes, num_warps=8, num_stages=3)


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
        if WIDEN:  # the interpreter: bfloat16 dots widened to float32 (the products are exact either way)
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _round(v, dtype: tl.constexpr, WIDEN: tl.constexpr):
        """float32 -> dtype, to nearest even. The interpreter truncates to bfloat16: there the rounding is done on
        the bits first (finite values), after which its conversion is exact."""
        if WIDEN:
            if dtype == tl.bfloat16:
                bits = v.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                v = bits.to(tl.float32, bitcast=True)
        return v.to(dtype)

    @triton.jit
    def _gate_up_kernel(X, W, SLOTS, BLOCK_EXPERT, Y, num_assignments, num_experts, inter, hidden, stride_x,
                        stride_we, stride_wn, stride_y, TOP_K: tl.constexpr, PRECISION: tl.constexpr,
                        WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Y[slot, n] = silu(x_t . gate[e, n]) * (x_t . up[e, n]) for the block's slots (t: the slot's token)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
        if expert >= num_experts:  # past the used blocks
            return
        slot = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        assignment = tl.load(SLOTS + slot)
        used = assignment < num_assignments
        token = (assignment // TOP_K).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        x_rows = X + token[:, None] * stride_x
        w_gate = W + expert * stride_we + n[None, :].to(tl.int64) * stride_wn  # [BLOCK_K, BLOCK_N] tiles
        w_up = w_gate + inter * stride_wn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            x = tl.load(x_rows + ks[None, :], mask=used[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            acc_gate = _dot(x, tl.load(w_gate + ks[:, None], mask=w_ok, other=0.0), acc_gate, PRECISION, WIDEN)
            acc_up = _dot(x, tl.load(w_up + ks[:, None], mask=w_ok, other=0.0), acc_up, PRECISION, WIDEN)
        dtype = X.dtype.element_ty  # rounded where F.silu(gate(x)) * up(x) rounds
        gate = _round(acc_gate, dtype, WIDEN).to(tl.float32)
        act = _round(gate / (1.0 + tl.exp(-gate)), dtype, WIDEN).to(tl.float32)
        out = act * _round(acc_up, dtype, WIDEN).to(tl.float32)
        tl.store(Y + slot.to(tl.int64)[:, None] * stride_y + n[None, :], _round(out, dtype, WIDEN),
                 mask=used[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(A, W, SLOTS, BLOCK_EXPERT, ROUTE_W, Y, num_assignments, num_experts, hidden, inter, stride_a,
                     stride_we, stride_wn, stride_y, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Y[assignment, n] = route_weight * (a_slot . down[e, n]) for the block's slots."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
        if expert >= num_experts:
            return
        slot = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        assignment = tl.load(SLOTS + slot)
        used = assignment < num_assignments
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        a_rows = A + slot.to(tl.int64)[:, None] * stride_a
        w_rows = W + expert * stride_we + n[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inter
            a = tl.load(a_rows + ks[None, :], mask=used[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, PRECISION, WIDEN)
        dtype = A.dtype.element_ty
        scale = tl.load(ROUTE_W + assignment, mask=used, other=0.0).to(tl.float32)
        out = _round(_round(acc, dtype, WIDEN).to(tl.float32) * scale[:, None], dtype, WIDEN)
        tl.store(Y + assignment.to(tl.int64)[:, None] * stride_y + n[None, :], out, mask=used[:, None] & n_ok[None, :])


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, tiling: Tiling | None = None) -> torch.Tensor:
    """The experts' weighted sum for each token, as `experts_reference`: x [T, H], gate_up [E, 2I, H], down
    [E, H, I], routing weights [T, k] (x's dtype) and ids [T, k]. Two Triton kernels on CUDA; torch elsewhere."""
    if not _use_triton(x):
        return experts_reference(x, gate_up, down, weights, ids)
    t, k = ids.shape
    num_experts, hidden, inter = down.shape
    if gate_up.shape != (num_experts, 2 * inter, hidden) or x.shape[1] != hidden:
        raise ValueError(f"moe: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} and x {tuple(x.shape)} "
                         "do not fit [E, 2I, H], [E, H, I] and [T, H]")
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("moe: the expert weights' rows must be contiguous")
    x = x.contiguous()
    n = t * k
    # both GEMMs take the same blocks: block_m follows from the assignments per expert alone
    t1 = tiling or choose_tiling(n, num_experts, inter, x.element_size(), _sm_count(x.device))
    t2 = tiling or choose_tiling(n, num_experts, hidden, x.element_size(), _sm_count(x.device))
    al = align(ids, num_experts, t1.block_m)
    blocks = al.block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    widen = bool(envs.TRITON_INTERPRET.get())
    act = torch.empty(al.slots.numel(), inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, t1.block_n))](
        x, gate_up, al.slots, al.block_expert, act, n, num_experts, inter, hidden, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), act.stride(0), TOP_K=k, PRECISION=precision, WIDEN=widen, BLOCK_M=t1.block_m,
        BLOCK_N=t1.block_n, BLOCK_K=t1.block_k, num_warps=t1.num_warps, num_stages=t1.num_stages)
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, t2.block_n))](
        act, down, al.slots, al.block_expert, weights.reshape(-1).contiguous(), out, n, num_experts, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0), PRECISION=precision, WIDEN=widen,
        BLOCK_M=t2.block_m, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, num_warps=t2.num_warps,
        num_stages=t2.num_stages)
    return out.view(t, k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
