"""A batch-1 decode step of Qwen2.5-Omni's talker decoder as one persistent CUDA kernel: a prototype, about as fast
as the kernel chain it would replace, and one that does not share the GPU (benchmarks/results/omni_qwen2_5.md,
runs 32 and 33).

benchmarks/persistent_step.py measured the design's ceiling (~0.94 ms a step for the released talker's weights
with six grid barriers a layer, against ~1.12 ms a code for today's ~200-kernel chain). This is the real thing
for the decoder layers: one CTA a SM; a producer warp streams the CTA's weight rows through a shared-memory ring
with bulk copies, layer after layer, regardless of the barriers; the consumer warps do each phase's arithmetic
and wait at the grid barriers between phases:

    qkv (RMSNorm, GEMV + bias) | attention (rotary, the new key and value into the paged cache, split over the
    context) | merge of the splits | o (GEMV + residual) | gate-up (RMSNorm, GEMV, SiLU * up) | down (GEMV +
    residual)

What does not depend on other CTAs is fetched before the barrier it would otherwise wait behind (the next
layer's norm weights and qkv bias, attention's older keys and values, by cp.async); what does is read in one
round trip per phase; the barrier is one 64-bit counter that only grows (run 33: 1.33 -> 1.14 ms a step).
Rounding follows transformers' bfloat16 Qwen2 layer (each op's output rounded to bfloat16); rows' sums are in a
fixed order (no atomics), so a step gives the same bits every time. The codec head and the draw stay outside.
On an H200 it matches a torch reference about as closely as transformers' own bfloat16 layers match float32
(2.22% against 2.02% after 24 random layers) and takes 1.13-1.15 ms a step (1.127 with a ring of 3 slots),
against ~1.05 ms estimated for the chain's 24 layers. The consumers' arithmetic, not the weight stream, sets
the GEMV phases' pace (CTA 0 works 12.3 µs of gate-up's 16 and waits 2.6 for slots). `--beside-solve` runs it
beside stand_in.py's DiT-shaped matmuls: the talker keeps its speed (+1.4%) because the matmuls finish nothing
while it runs, whatever its ring or thread count, on cuBLAS or in small Triton tiles: they run only on SMs it
leaves free (the chain: talker at 38% of its speed, the matmuls at 81%; runs 33j-33n).

    python benchmarks/persistent_talker.py --out persistent_talker.jsonl        # GPU (torch's NVRTC compiles it)
    python benchmarks/persistent_talker.py --layers 1 --ctas 132 --depths 8     # each phase checked at one layer
    python benchmarks/persistent_talker.py --ctas 132 --beside-solve            # beside a stand-in solve
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics

import numpy as np
import stand_in
import torch
import torch.nn.functional as F
from persistent_step import BULK_RING
from recording import recorder

HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD_DIM = 896, 18944, 12, 4, 128
ATTN = Q_HEADS * HEAD_DIM
QKV = ATTN + 2 * KV_HEADS * HEAD_DIM
PHASES = 6  # qkv, attention, merge, o, gate-up, down
SEG = 128  # elements a half-warp sums at once
CONSUMERS = 256
# ring slot (bytes): 16 rows of 896 (two a consumer warp), 9 of 1536, or half a row of 18944. Against 8 rows of 896
# (14 KB): gate-up 26 -> 17 µs, the step 1.46 -> 1.33 ms (run 32d: fewer waits and arrivals a byte)
SLOT = 28672
MAX_ROWS = 64  # a CTA's qkv rows (or rows of h) kept in shared memory: 20 (7) on 132 CTAs

SOURCE = r"""
#include <cuda_bf16.h>
typedef unsigned long long u64;
typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 b(float x) { return __float2bfloat16(x); }
__device__ __forceinline__ float r(float x) { return __bfloat162float(__float2bfloat16(x)); }  // rounded

// What other CTAs wrote in this launch: read from L2 with volatile asm, so the compiler can neither cache it
// in L1 nor reuse an earlier load of the same address (__ldcg's loads were merged across phases).
__device__ __forceinline__ float ld_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint4 ld_v4(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p) : "memory");
    return v;
}

""" + BULK_RING + r"""
// 16 B from global to shared memory without registers; cp.async.wait_all (each thread, then a bar.sync) before
// reading them
__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void async_copies_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS) : "memory"); }

// every consumer of every CTA: release what this CTA wrote, acquire what the others did. One 64-bit counter that
// only grows: this launch's barrier n is passed once it reaches `target` (base + (n + 1) * ctas). Thread 0's
// release, after the CTA's bar.sync, publishes the other threads' stores too (release is cumulative), so no
// thread fences on its own; nothing resets the counter, so no arrival waits on a reset.
__device__ __forceinline__ void grid_barrier(u64* count, u64 target, long long* clock_slot = nullptr) {
    if (clock_slot != nullptr && threadIdx.x == 0 && blockIdx.x == 0) clock_slot[0] = clock64();  // work done
    consumers_sync();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" :: "l"(count) : "memory");
        u64 now;
        do {
            asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(now) : "l"(count) : "memory");
        } while (now < target);
        if (clock_slot != nullptr && blockIdx.x == 0) clock_slot[1] = clock64();  // everyone arrived
    }
    consumers_sync();
}

__device__ __forceinline__ float block_sum(float v, float* red) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    consumers_sync();
    float total = 0.f;
    #pragma unroll
    for (int w = 0; w < CONSUMERS / 32; w++) total += red[w];
    consumers_sync();
    return total;
}

// xs = weight * bf16(h * rsqrt(mean(h^2) + eps)), as transformers' Qwen2RMSNorm in bfloat16. h comes from L2
// in one round trip (16 B a thread) into xs, which is then normalised in place.
__device__ void rms_norm(const bf16* h, const bf16* weight, bf16* xs, float eps, float* red) {
    for (int k = threadIdx.x; k < HIDDEN / 8; k += CONSUMERS)
        reinterpret_cast<uint4*>(xs)[k] = ld_v4(reinterpret_cast<const uint4*>(h) + k);
    consumers_sync();
    float ss = 0.f;
    for (int k = threadIdx.x; k < HIDDEN; k += CONSUMERS) { const float v = f(xs[k]); ss += v * v; }
    const float rstd = rsqrtf(block_sum(ss, red) / HIDDEN + eps);
    for (int k = threadIdx.x; k < HIDDEN; k += CONSUMERS) xs[k] = b(f(weight[k]) * r(f(xs[k]) * rstd));
    consumers_sync();
}

// n values (a multiple of 8) from L2 into xs, every 16 B copied asynchronously (L2 only, .cg): one round trip
__device__ void load_vector(const bf16* src, bf16* xs, int n) {
    for (int k = threadIdx.x; k < n / 8; k += CONSUMERS)
        copy16_async(reinterpret_cast<uint4*>(xs) + k, reinterpret_cast<const uint4*>(src) + k);
    async_copies_wait();
    consumers_sync();
}

__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
    #pragma unroll
    for (int q = 0; q < 4; q++) {
        const float2 wf = __bfloat1622float2(w2[q]), xf = __bfloat1622float2(x2[q]);
        acc = fmaf(wf.x, xf.x, acc);
        acc = fmaf(wf.y, xf.y, acc);
    }
    return acc;
}

#ifdef NO_MATH
#define NO_MATH_ON true
#else
#define NO_MATH_ON false
#endif

// One GEMV phase's chunks against xs; part[local row] gets each row's sum (in a fixed order). Short rows (a
// chunk holds whole rows): a warp a row. Long rows (a chunk holds a piece of one): each thread keeps a running
// sum over the row's pieces, summed across the block after its last one. Returns the ring position after.
__device__ int gemv(const u64* slot_meta, const int* phase, int i, const bf16* xs, float* part, int row_vecs,
                    const char* ring, u64* full, u64* empty, float* red, long long* stats) {
    // stats (CTA 0's thread 0, summed over the layers): clocks waiting for a full slot, then working on it
    const bool timed = blockIdx.x == 0 && threadIdx.x == 0;
    long long waited = 0, worked = 0, t = timed ? clock64() : 0;
    const int n = phase[1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint4* xv = reinterpret_cast<const uint4*>(xs);
    float acc4[4] = {0.f, 0.f, 0.f, 0.f};  // long rows: this thread's running sums over the row's pieces
    float next4[4] = {0.f, 0.f, 0.f, 0.f};  // and over the next row's, where a slot runs past a row's end
    for (int c = 0; c < n; c++, i++) {
        const int slot = i % DEPTH;
        mbar_wait(&full[slot], (i / DEPTH) & 1);
        if (timed) { const long long now = clock64(); waited += now - t; t = now; }
        const u64 meta = slot_meta[2 * slot], shape = slot_meta[2 * slot + 1];
        const int row0 = (int)(meta >> 32), seg0 = (int)(shape & 0xffff), rows = (int)((shape >> 16) & 0xffff);
        const int segs = (int)((shape >> 32) & 0xffff);
        const uint4* wv = reinterpret_cast<const uint4*>(ring + slot * SLOT);
        const bool whole = segs * SEG == row_vecs * 8 && seg0 == 0;
#ifdef NO_MATH  // timing only: the ring's traffic without the consumers' arithmetic
        if (false) {
#else
        if (whole) {
#endif
            // a warp's two rows (warp, warp + 8) at once: the input vector read once for both and twice the
            // independent loads and sums in flight (run 33h: the consumers, not the stream, set gate-up's pace)
            constexpr int WARPS = CONSUMERS / 32;
            for (int rr = warp; rr < rows; rr += 2 * WARPS) {
                const bool two = rr + WARPS < rows;
                const uint4* w1 = wv + rr * row_vecs;
                const uint4* w2 = w1 + WARPS * row_vecs;
                float s1[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};
                for (int q0 = lane; q0 < row_vecs; q0 += 128) {
                    uint4 x4[4], a4[4], b4[4];
                    #pragma unroll
                    for (int u = 0; u < 4; u++) {
                        const int q = q0 + 32 * u;
                        if (q < row_vecs) {
                            x4[u] = xv[q];
                            a4[u] = w1[q];
                            if (two) b4[u] = w2[q];
                        }
                    }
                    #pragma unroll
                    for (int u = 0; u < 4; u++) {
                        if (q0 + 32 * u < row_vecs) {
                            s1[u] = dot8(a4[u], x4[u], s1[u]);
                            if (two) s2[u] = dot8(b4[u], x4[u], s2[u]);
                        }
                    }
                }
                float v1 = (s1[0] + s1[1]) + (s1[2] + s1[3]), v2 = (s2[0] + s2[1]) + (s2[2] + s2[3]);
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    v1 += __shfl_xor_sync(0xffffffffu, v1, o);
                    v2 += __shfl_xor_sync(0xffffffffu, v2, o);
                }
                if (lane == 0) {
                    part[row0 + rr] = v1;
                    if (two) part[row0 + rr + WARPS] = v2;
                }
            }
        } else if (!NO_MATH_ON) {  // a slot of a long row, maybe running into the next one (at most one end)
            const int piece_vecs = segs * SEG / 8, col0 = seg0 * SEG / 8;
            for (int q0 = threadIdx.x; q0 < piece_vecs; q0 += 4 * CONSUMERS) {
                uint4 w4[4], x4[4];
                #pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int q = q0 + CONSUMERS * u, col = col0 + q;
                    if (q < piece_vecs) { w4[u] = wv[q]; x4[u] = xv[col < row_vecs ? col : col - row_vecs]; }
                }
                #pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int q = q0 + CONSUMERS * u;
                    if (q < piece_vecs) {
                        if (col0 + q < row_vecs) acc4[u] = dot8(w4[u], x4[u], acc4[u]);
                        else next4[u] = dot8(w4[u], x4[u], next4[u]);
                    }
                }
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
        if (timed) { const long long now = clock64(); worked += now - t; t = now; }
        if (!whole && (seg0 + segs) * SEG >= row_vecs * 8) {  // the slot ends row0: its sum, then the next row's
            const float v = block_sum((acc4[0] + acc4[1]) + (acc4[2] + acc4[3]), red);
            if (threadIdx.x == 0) part[row0] = v;
            #pragma unroll
            for (int u = 0; u < 4; u++) { acc4[u] = next4[u]; next4[u] = 0.f; }
        }
    }
    if (timed) { stats[0] += waited; stats[1] += worked; }
    consumers_sync();
    return i;
}

// h[row] += the phase's row sum (rounded to bfloat16, as a linear's output) for this CTA's rows of the phase.
// o and down give a CTA the same rows of h and no other CTA writes them: the CTA keeps its own copy (own), so
// the residual needs no read from L2.
__device__ void add_to_residual(bf16* h, bf16* own, const float* part, const int* phase) {
    for (int rr = threadIdx.x; rr < phase[3] - phase[2]; rr += CONSUMERS) {
        const bf16 v = b(f(own[rr]) + r(part[rr]));
        own[rr] = v;
        h[phase[2] + rr] = v;
    }
}

// the item's older keys and values (all but the new one, which this step writes) into ks, vs, copied
// asynchronously: for a CTA's first item they are issued before the barrier attention waits behind
__device__ void fetch_old_kv(int item, int ctx, const bf16* kc, const bf16* vc, const int* pages, bf16* xs) {
    const int g = item / SPLITS, s = item % SPLITS;
    const int per = (ctx + SPLITS - 1) / SPLITS, start = s * per, end = min(start + per, ctx);
    bf16* ks = xs;
    bf16* vs = xs + per * HEAD_DIM;
    for (int idx = threadIdx.x; idx < (end - start) * 16; idx += CONSUMERS) {
        const int key = idx >> 4, q = idx & 15, j = start + key;
        if (j == ctx - 1) continue;
        const u64 off = (((u64)pages[j / PAGE] * PAGE + j % PAGE) * KV_HEADS + g) * HEAD_DIM + q * 8;
        copy16_async(ks + idx * 8, kc + off);
        copy16_async(vs + idx * 8, vc + off);
    }
}

// a layer's norm weights and the 16-byte blocks holding this CTA's qkv bias rows into shared memory,
// asynchronously: no CTA writes them, so they are fetched while the layer before still streams
__device__ void fetch_layer_params(const u64* lt, const int* qkv_phase, bf16* norm_in, bf16* norm_post,
                                   bf16* bias) {
    const int first = qkv_phase[2] / 8, blocks = (qkv_phase[3] + 7) / 8 - first;
    for (int t = threadIdx.x; t < HIDDEN / 4 + blocks; t += CONSUMERS) {
        if (t < HIDDEN / 8)
            copy16_async(reinterpret_cast<uint4*>(norm_in) + t, reinterpret_cast<const uint4*>(lt[0]) + t);
        else if (t < HIDDEN / 4)
            copy16_async(reinterpret_cast<uint4*>(norm_post) + t - HIDDEN / 8,
                         reinterpret_cast<const uint4*>(lt[1]) + t - HIDDEN / 8);
        else
            copy16_async(reinterpret_cast<uint4*>(bias) + t - HIDDEN / 4,
                         reinterpret_cast<const uint4*>(lt[2]) + first + t - HIDDEN / 4);
    }
}

// q or k of one head (staged in shared memory), rotated as transformers' rotate_half in bfloat16:
// q*cos + rotate_half(q)*sin
__device__ __forceinline__ float rotated(const bf16* x, const bf16* cos, const bf16* sin, int d) {
    const float other = d < HEAD_DIM / 2 ? -f(x[d + HEAD_DIM / 2]) : f(x[d - HEAD_DIM / 2]);
    return r(r(f(x[d]) * f(cos[d])) + r(other * f(sin[d])));
}

// tables: layer_tab[layer] = in_norm, post_norm, qkv bias, k cache, v cache (addresses); phase_tab[(layer*6 +
// phase) * ctas + cta] = first chunk, chunks, first row, end row; chunks[c] = source address, (local row << 32 |
// bytes), (segments << 32 | rows << 16 | first segment), each CTA's chunks together in its stream's order, from
// cta_chunks[cta] to cta_chunks[cta + 1]
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
talker_layers(const u64* __restrict__ chunks, const int* __restrict__ cta_chunks, const int* __restrict__ phase_tab,
              const u64* __restrict__ layer_tab, int layers, const bf16* __restrict__ final_norm, bf16* h, bf16* qkv,
              bf16* attn, bf16* act, float* att_part, bf16* out, const bf16* __restrict__ cos,
              const bf16* __restrict__ sin, const int* __restrict__ block_table, const int* __restrict__ seq_len,
              const int* __restrict__ new_slot,
              u64* barrier, long long* clocks, bf16* xs_seen, long long* gemv_stats) {
    extern __shared__ __align__(128) char smem[];
    bf16* xs = reinterpret_cast<bf16*>(smem);
    float* part = reinterpret_cast<float*>(smem + INTER * 2);
    char* ring = smem + INTER * 2 + PART_FLOATS * 4;
    __shared__ __align__(8) u64 full[DEPTH], empty[DEPTH];
    __shared__ u64 slot_meta[2 * DEPTH];  // each slot's chunk: (local row << 32 | bytes), shape
    __shared__ float red[32];
    __shared__ float stat[8];
    __shared__ int pages[MAX_PAGES];  // the sequence's block table
    __shared__ __align__(16) bf16 staged[(GROUP + 2) * HEAD_DIM];  // attention: a kv group's q, new k and new v
    __shared__ __align__(16) bf16 norm_in[HIDDEN], norm_post[HIDDEN];  // the layer's norm weights
    __shared__ __align__(16) bf16 qkv_bias[MAX_ROWS + 16];  // the layer's bias: the blocks with this CTA's rows
    __shared__ bf16 rope[2 * HEAD_DIM];   // cos, sin
    __shared__ bf16 own[MAX_ROWS];        // this CTA's rows of h (o's and down's)
    const int tid = threadIdx.x, cta = blockIdx.x, ctas = gridDim.x;
    const float eps = EPS, scale = SCALE;
    if (tid == 0) {
        for (int s = 0; s < DEPTH; s++) { mbar_init(&full[s], 1); mbar_init(&empty[s], CONSUMERS / 32); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid >= CONSUMERS) {  // the producer warp: every weight chunk of this CTA, in order
        const int lane = tid - CONSUMERS;
        const int total = cta_chunks[cta + 1] - cta_chunks[cta];
        const u64* mine = chunks + 3 * (u64)cta_chunks[cta];
        int ahead = 0;  // chunks handed to L2's prefetch so far
        for (int c0 = 0; c0 < total; c0 += 32) {  // the lanes read 32 chunks' entries at once
            u64 src = 0, meta = 0, shape = 0;
            if (c0 + lane < total) {
                const u64* e = mine + 3 * (c0 + lane);
                src = e[0]; meta = e[1]; shape = e[2];
            }
            for (int c = 0; c < min(32, total - c0); c++) {
                const int i = c0 + c;
                // keep L2 PREFETCH chunks ahead of the copies, topped up a quarter at a time
                const int target = min(total, i + PREFETCH);
                if (PREFETCH > 0 && ahead < target - PREFETCH / 4) {
                    for (; ahead < target; ahead += 32) {
                        const int j = ahead + lane;
                        if (j < target) {
                            const u64* e = mine + 3 * j;
                            prefetch_l2(reinterpret_cast<const void*>(e[0]), (unsigned)(e[1] & 0xffffffffu));
                        }
                    }
                    ahead = target;
                }
                const u64 s_src = __shfl_sync(0xffffffffu, src, c), s_meta = __shfl_sync(0xffffffffu, meta, c);
                const u64 s_shape = __shfl_sync(0xffffffffu, shape, c);
                if (lane == 0) {
                    const int slot = i % DEPTH;
                    mbar_wait(&empty[slot], ((i / DEPTH) & 1) ^ 1);
                    slot_meta[2 * slot] = s_meta;
                    slot_meta[2 * slot + 1] = s_shape;
                    mbar_expect_tx(&full[slot], (unsigned)(s_meta & 0xffffffffu));
                    COPY(ring + slot * SLOT, reinterpret_cast<const void*>(s_src), (unsigned)(s_meta & 0xffffffffu),
                         &full[slot]);
                }
                __syncwarp();
            }
        }
        return;
    }
    const int ctx = *seq_len, slot_new = *new_slot;
    // barrier[0] counts every arrival since the buffers were made, barrier[1] the steps before this one
    u64 steps;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(steps) : "l"(barrier + 1) : "memory");
    const u64 base = steps * (u64)(layers * PHASES) * ctas;
    #define SYNC(layer, phase) grid_barrier(barrier, base + (u64)((layer) * PHASES + (phase) + 1) * ctas, \
                                            clocks + 2 * ((layer) * PHASES + (phase)))
    for (int j = tid; j < (ctx + PAGE - 1) / PAGE; j += CONSUMERS) pages[j] = block_table[j];
    for (int d = tid; d < HEAD_DIM; d += CONSUMERS) { rope[d] = cos[d]; rope[HEAD_DIM + d] = sin[d]; }
    {
        const int* own_phase = phase_tab + 4 * (3 * ctas + cta);  // layer 0's o: the same rows as every o and down
        for (int rr = tid; rr < own_phase[3] - own_phase[2]; rr += CONSUMERS) own[rr] = h[own_phase[2] + rr];
        fetch_layer_params(layer_tab, phase_tab + 4 * cta, norm_in, norm_post, qkv_bias);
    }
    const bf16* cs = rope;
    const bf16* sn = rope + HEAD_DIM;
    int i = 0;
    for (int layer = 0; layer < layers; layer++) {
        const u64* lt = layer_tab + 5 * layer;
        const int* ph = phase_tab + 4 * (layer * 6 * ctas + cta);
        const int stride = 4 * ctas;  // from one phase's entry of this CTA to the next phase's
        // qkv: RMSNorm, then this CTA's rows with their bias
        async_copies_wait();  // this layer's norm weights
        consumers_sync();
        rms_norm(h, norm_in, xs, eps, red);
        i = gemv(slot_meta, ph, i, xs, part, HIDDEN / 8, ring, full, empty, red, gemv_stats + 0);
        if (cta < KV_HEADS * SPLITS)  // xs is free: attention's older keys and values load during the barrier
            fetch_old_kv(cta, ctx, reinterpret_cast<const bf16*>(lt[3]), reinterpret_cast<const bf16*>(lt[4]), pages,
                         xs);
        for (int rr = tid; rr < ph[3] - ph[2]; rr += CONSUMERS)
            qkv[ph[2] + rr] = b(part[rr] + f(qkv_bias[ph[2] % 8 + rr]));
        SYNC(layer, 0);
        // attention: work items (kv head, split) over the CTAs
        for (int item = cta; item < KV_HEADS * SPLITS; item += ctas) {
            const int g = item / SPLITS, s = item % SPLITS;
            const int per = (ctx + SPLITS - 1) / SPLITS, start = s * per, end = min(start + per, ctx);
            float* qs = part;                      // [GROUP][HEAD_DIM] rotated queries
            float* kn = part + GROUP * HEAD_DIM;   // the new key (rotated) and value
            float* vn = kn + HEAD_DIM;
            float* sc = vn + HEAD_DIM;             // [GROUP][per] scores, then probabilities
            bf16* kc = reinterpret_cast<bf16*>(lt[3]);
            bf16* vc = reinterpret_cast<bf16*>(lt[4]);
            {  // the group's queries, new key and new value from L2 in one round trip
                constexpr int QV = GROUP * HEAD_DIM / 8, KV = HEAD_DIM / 8;
                const uint4* q = reinterpret_cast<const uint4*>(qkv + g * GROUP * HEAD_DIM);
                const uint4* k = reinterpret_cast<const uint4*>(qkv + ATTN + g * HEAD_DIM);
                const uint4* v = reinterpret_cast<const uint4*>(qkv + ATTN + (KV_HEADS + g) * HEAD_DIM);
                for (int t = tid; t < QV + 2 * KV; t += CONSUMERS) {
                    const uint4* src = t < QV ? q + t : t < QV + KV ? k + t - QV : v + t - QV - KV;
                    reinterpret_cast<uint4*>(staged)[t] = ld_v4(src);
                }
            }
            consumers_sync();
            for (int idx = tid; idx < GROUP * HEAD_DIM; idx += CONSUMERS)
                qs[idx] = rotated(staged + (idx / HEAD_DIM) * HEAD_DIM, cs, sn, idx % HEAD_DIM);
            const bool owns_new = start <= ctx - 1 && ctx - 1 < end;
            if (owns_new) {
                for (int d = tid; d < HEAD_DIM; d += CONSUMERS) {
                    const float k = rotated(staged + GROUP * HEAD_DIM, cs, sn, d);
                    const float v = f(staged[(GROUP + 1) * HEAD_DIM + d]);
                    kn[d] = k;
                    vn[d] = v;
                    kc[((u64)slot_new * KV_HEADS + g) * HEAD_DIM + d] = b(k);
                    vc[((u64)slot_new * KV_HEADS + g) * HEAD_DIM + d] = b(v);
                }
            }
            consumers_sync();
            // the slice's keys and values in shared memory (xs is free until o): the older ones copied since
            // before the barrier (a later item's now), the new one from kn, vn
            if (item != cta) fetch_old_kv(item, ctx, kc, vc, pages, xs);
            async_copies_wait();
            bf16* ks = xs;
            bf16* vs = xs + per * HEAD_DIM;
            if (owns_new) {
                const int key = ctx - 1 - start;
                for (int d = tid; d < HEAD_DIM; d += CONSUMERS) {
                    ks[key * HEAD_DIM + d] = b(kn[d]);
                    vs[key * HEAD_DIM + d] = b(vn[d]);
                }
            }
            consumers_sync();
            const int lane = tid & 31, warp = tid >> 5;
            for (int key = warp; key < end - start; key += CONSUMERS / 32) {  // a warp a key: 4 dims a lane
                float dot[GROUP];
                #pragma unroll
                for (int hh = 0; hh < GROUP; hh++) dot[hh] = 0.f;
                #pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int d = lane * 4 + q;
                    const float k = f(ks[key * HEAD_DIM + d]);
                    #pragma unroll
                    for (int hh = 0; hh < GROUP; hh++) dot[hh] = fmaf(qs[hh * HEAD_DIM + d], k, dot[hh]);
                }
                #pragma unroll
                for (int hh = 0; hh < GROUP; hh++) {
                    float v = dot[hh];
                    #pragma unroll
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (lane == 0) sc[hh * per + key] = v * scale;
                }
            }
            consumers_sync();
            if (warp < GROUP) {  // a warp a head: max, then probabilities and their sum
                float m = -1e30f;
                for (int j = lane; j < end - start; j += 32) m = fmaxf(m, sc[warp * per + j]);
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                float l = 0.f;
                for (int j = lane; j < end - start; j += 32) {
                    const float p = __expf(sc[warp * per + j] - m);
                    sc[warp * per + j] = p;
                    l += p;
                }
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
                if (lane == 0) { stat[2 * warp] = m; stat[2 * warp + 1] = l; }
            }
            consumers_sync();
            for (int idx = tid; idx < GROUP * HEAD_DIM; idx += CONSUMERS) {
                const int hh = idx / HEAD_DIM, d = idx % HEAD_DIM;
                float a = 0.f;
                for (int key = 0; key < end - start; key++) a = fmaf(sc[hh * per + key], f(vs[key * HEAD_DIM + d]), a);
                float* dst = att_part + ((u64)(g * GROUP + hh) * SPLITS + s) * (HEAD_DIM + 2);
                dst[2 + d] = a;
                if (d == 0) { dst[0] = stat[2 * hh]; dst[1] = stat[2 * hh + 1]; }
            }
            consumers_sync();  // the next item reuses the shared scratch
        }
        SYNC(layer, 1);
        // merge the splits: 1536 outputs over the CTAs, a warp an output, a lane a split (its three values
        // read at once: one round trip)
        {
            const int per_cta = (ATTN + ctas - 1) / ctas, lane = tid & 31;
            for (int idx = cta * per_cta + (tid >> 5); idx < min(ATTN, (cta + 1) * per_cta); idx += CONSUMERS / 32) {
                const int head = idx / HEAD_DIM, d = idx % HEAD_DIM;
                const float* src = att_part + ((u64)head * SPLITS + lane) * (HEAD_DIM + 2);
                float ms = -1e30f, ls = 0.f, as = 0.f;
                if (lane < SPLITS) { ms = ld_f32(src); ls = ld_f32(src + 1); as = ld_f32(src + 2 + d); }
                float m = ms;
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                const float w = lane < SPLITS ? __expf(ms - m) : 0.f;
                float l = w * ls, a = w * as;
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    l += __shfl_xor_sync(0xffffffffu, l, o);
                    a += __shfl_xor_sync(0xffffffffu, a, o);
                }
                if (lane == 0) attn[idx] = b(a / l);
            }
        }
        SYNC(layer, 2);
        // o, then the residual
        load_vector(attn, xs, ATTN);
        i = gemv(slot_meta, ph + 3 * stride, i, xs, part, ATTN / 8, ring, full, empty, red, gemv_stats + 2);
        add_to_residual(h, own, part, ph + 3 * stride);
        SYNC(layer, 3);
        // gate-up: RMSNorm, gate rows then up rows of this CTA's features, SiLU(gate) * up
        rms_norm(h, norm_post, xs, eps, red);
        if (cta == 0) for (int k = tid; k < HIDDEN; k += CONSUMERS) xs_seen[k] = xs[k];  // the last layer's (checks)
        i = gemv(slot_meta, ph + 4 * stride, i, xs, part, HIDDEN / 8, ring, full, empty, red, gemv_stats + 4);
        {
            const int f0 = ph[4 * stride + 2], nf = ph[4 * stride + 3] - f0;
            for (int rr = tid; rr < nf; rr += CONSUMERS) {
                const float gate = r(part[rr]), up = r(part[nf + rr]);
                act[f0 + rr] = b(r(gate / (1.f + __expf(-gate))) * up);
            }
        }
        SYNC(layer, 4);
        // down, then the residual; the next layer's norm weights and bias arrive meanwhile (this layer's are used)
        if (layer + 1 < layers) fetch_layer_params(lt + 5, ph + 6 * stride, norm_in, norm_post, qkv_bias);
        load_vector(act, xs, INTER);
        i = gemv(slot_meta, ph + 5 * stride, i, xs, part, INTER / 8, ring, full, empty, red, gemv_stats + 6);
        add_to_residual(h, own, part, ph + 5 * stride);
        SYNC(layer, 5);
    }
    if (cta == 0) {
        rms_norm(h, final_norm, out, eps, red);
        if (tid == 0) barrier[1] += 1;  // every CTA has read this step's base: it has passed the last barrier
    }
}
"""


def chunk_tables(layers: list[dict], ctas: int, slot: int = SLOT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the producer warps stream: chunks [n, 3] (source address, local row << 32 | bytes, segments << 32 |
    rows << 16 | first segment), each CTA's in its stream's order and together (from cta_chunks[cta] to
    cta_chunks[cta + 1]), and phases [layers, PHASES, ctas, 4] (first chunk, chunks, first row, end row; for gate-up
    the rows are features, its gate rows then its up rows). A chunk holds whole rows (up to `slot` bytes) or, for
    rows longer than a slot, `slot` bytes of the CTA's rows (one range in memory), running across row ends: full
    slots (down's rows of 37 KB in 28 KB slots, not halves of 18.5 KB)."""
    per_cta: list[list[tuple[int, int, int]]] = [[] for _ in range(ctas)]
    phases = np.zeros((len(layers), PHASES, ctas, 4), dtype=np.int32)

    def add(chunks: list, weight: torch.Tensor, row_ranges: list[tuple[int, int]]) -> None:
        k = weight.shape[1]
        row_bytes, local = k * 2, 0
        for a, b in row_ranges:
            if row_bytes <= slot:
                per = slot // row_bytes
                for r0 in range(a, b, per):
                    n = min(per, b - r0)
                    chunks.append((weight.data_ptr() + r0 * row_bytes, (local + r0 - a) << 32 | n * row_bytes,
                                   (k // SEG) << 32 | n << 16))
            else:  # the CTA's rows are one range in memory: slots of it, running across row ends
                seg_bytes, total = SEG * 2, (b - a) * row_bytes
                assert slot % seg_bytes == 0 and row_bytes % seg_bytes == 0 and slot < row_bytes
                for off in range(0, total, slot):
                    n, (row, col) = min(slot, total - off), divmod(off, row_bytes)
                    chunks.append((weight.data_ptr() + a * row_bytes + off, (local + row) << 32 | n,
                                   (n // seg_bytes) << 32 | 1 << 16 | col // seg_bytes))
            local += b - a

    def split(n: int) -> list[tuple[int, int]]:
        per = -(-n // ctas)
        return [(min(c * per, n), min((c + 1) * per, n)) for c in range(ctas)]

    for li, w in enumerate(layers):
        for phase, name, rows in ((0, "qkv_w", QKV), (3, "o_w", HIDDEN), (4, "gate_up_w", INTER),
                                  (5, "down_w", HIDDEN)):
            for c, (a, b) in enumerate(split(rows)):
                first = len(per_cta[c])
                add(per_cta[c], w[name], [(a, b), (INTER + a, INTER + b)] if name == "gate_up_w" else [(a, b)])
                phases[li, phase, c] = (first, len(per_cta[c]) - first, a, b)
    cta_chunks = np.cumsum([0] + [len(c) for c in per_cta]).astype(np.int32)
    phases[..., 0] += cta_chunks[:-1]
    chunks = np.array([e for c in per_cta for e in c], dtype=np.uint64).view(np.int64).reshape(-1, 3)
    return chunks, cta_chunks, phases


class PersistentTalker:
    """The decoder layers' weights as chunk tables for `talker_layers`, and its launch."""

    def __init__(self, layers: list[dict], final_norm: torch.Tensor, ctas: int, depth: int, splits: int,
                 page: int, eps: float, no_math: bool = False, consumers: int = CONSUMERS, slot: int = SLOT,
                 prefetch_kb: int = 0, evict_first: bool = False):
        dev = final_norm.device
        self.ctas, self.depth, self.splits, self.layers = ctas, depth, splits, layers
        self.final_norm = final_norm
        self.consumers = consumers
        self.chunks, self.cta_chunks, self.phases = (torch.tensor(t, device=dev)
                                                     for t in chunk_tables(layers, ctas, slot))
        self.layer_tab = torch.tensor(np.array([[w["in_norm"].data_ptr(), w["post_norm"].data_ptr(),
                                                 w["qkv_b"].data_ptr(), w["k_cache"].data_ptr(),
                                                 w["v_cache"].data_ptr()] for w in layers],
                                               dtype=np.uint64).view(np.int64), device=dev)
        part_floats = 2048  # a phase's row sums (at most 2 x 144 gate-up rows a CTA), or attention's scratch
        assert 2 * -(-INTER // ctas) <= part_floats
        per_split = min((part_floats - (Q_HEADS // KV_HEADS + 2) * HEAD_DIM) // (Q_HEADS // KV_HEADS),
                        INTER // (2 * HEAD_DIM))  # scores in `part`, the slice's keys and values in `xs`
        self.max_context = per_split * splits
        assert splits <= 32, "the merge gives each split a lane"
        assert -(-QKV // ctas) <= MAX_ROWS and -(-HIDDEN // ctas) <= MAX_ROWS, "rows a CTA keeps in shared memory"
        o_rows, down_rows = self.phases[:, 3, :, 2:].cpu(), self.phases[:, 5, :, 2:].cpu()
        assert torch.equal(o_rows, down_rows) and torch.equal(o_rows, o_rows[:1].expand_as(o_rows)), \
            "a CTA's rows of h are the same in o and down, every layer (it keeps its own copy)"
        self.smem = INTER * 2 + part_floats * 4 + depth * slot
        options = [f"-DCONSUMERS={consumers}", f"-DDEPTH={depth}", f"-DSLOT={slot}", f"-DSEG={SEG}",
                   f"-DHIDDEN={HIDDEN}", f"-DINTER={INTER}", f"-DATTN={ATTN}", f"-DKV_HEADS={KV_HEADS}",
                   f"-DHEAD_DIM={HEAD_DIM}", f"-DGROUP={Q_HEADS // KV_HEADS}", f"-DSPLITS={splits}",
                   f"-DPAGE={page}", f"-DPART_FLOATS={part_floats}", f"-DPHASES={PHASES}",
                   f"-DMAX_PAGES={-(-self.max_context // page)}", f"-DMAX_ROWS={MAX_ROWS}", f"-DEPS={eps!r}f",
                   f"-DSCALE={1 / math.sqrt(HEAD_DIM)!r}f", f"-DPREFETCH={prefetch_kb * 1024 // slot}",
                   f"-DCOPY={'bulk_copy_evict_first' if evict_first else 'bulk_copy'}", "-std=c++17",
                   *(["-DNO_MATH"] if no_math else [])]
        self.kernel = torch.cuda._compile_kernel(SOURCE, "talker_layers", nvcc_options=options)
        if hasattr(self.kernel, "set_shared_memory_config"):
            self.kernel.set_shared_memory_config(self.smem)
        else:  # older torch: the attribute through the driver
            import ctypes

            libcuda = torch.cuda._utils._get_gpu_runtime_library()
            assert libcuda.cuFuncSetAttribute(self.kernel.func, 8, ctypes.c_int(self.smem)) == 0  # max dynamic smem
        self.scratch = {"qkv": torch.empty(QKV, dtype=torch.bfloat16, device=dev),
                        "attn": torch.empty(ATTN, dtype=torch.bfloat16, device=dev),
                        "act": torch.empty(INTER, dtype=torch.bfloat16, device=dev),
                        "att_part": torch.empty(Q_HEADS * splits * (HEAD_DIM + 2), dtype=torch.float32, device=dev),
                        "barrier": torch.zeros(2, dtype=torch.int64, device=dev),  # arrivals, steps
                        # CTA 0's clock when its work in each phase was done and when every CTA had arrived
                        "clocks": torch.zeros(len(layers) * PHASES * 2, dtype=torch.int64, device=dev),
                        "xs_seen": torch.zeros(HIDDEN, dtype=torch.bfloat16, device=dev),  # gate-up's input
                        # CTA 0's thread 0 in qkv, o, gate-up, down: clocks waiting for full slots, then working
                        "gemv_stats": torch.zeros(8, dtype=torch.int64, device=dev)}

    def __call__(self, h: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 block_table: torch.Tensor, seq_len: torch.Tensor, new_slot: torch.Tensor) -> None:
        """One step: h [HIDDEN] (bfloat16) is the first layer's input and becomes the last layer's output
        (before the final norm); out [HIDDEN] gets the final norm of it."""
        s = self.scratch
        self.kernel(grid=(self.ctas, 1, 1), block=(self.consumers + 32, 1, 1), shared_mem=self.smem,
                    args=[self.chunks, self.cta_chunks, self.phases, self.layer_tab, len(self.layers),
                          self.final_norm, h, s["qkv"], s["attn"], s["act"], s["att_part"], out, cos, sin,
                          block_table, seq_len, new_slot,
                          s["barrier"], s["clocks"], s["xs_seen"], s["gemv_stats"]])


def reference(h: torch.Tensor, layers: list[dict], final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              ctx: int, page: int, block_table: torch.Tensor, new_slot: int, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen2 decoder layers for one token (the cache holds ctx - 1 earlier keys), in the dtype of
    the weights and h: (the final norm's output, the last layer's output)."""
    def norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rotate(x):  # [heads, D]
        half = HEAD_DIM // 2
        return x * cos + torch.cat([-x[:, half:], x[:, :half]], dim=-1) * sin

    seen = {}  # the last layer's intermediates (for a mismatch's first suspect)
    positions = torch.arange(ctx, device=h.device)
    slots = block_table[positions // page] * page + positions % page
    for w in layers:
        residual = h
        qkv = seen["qkv"] = F.linear(norm(h, w["in_norm"]), w["qkv_w"], w["qkv_b"])
        q = rotate(qkv[:ATTN].view(Q_HEADS, HEAD_DIM))
        k = rotate(qkv[ATTN:ATTN + KV_HEADS * HEAD_DIM].view(KV_HEADS, HEAD_DIM))
        v = qkv[ATTN + KV_HEADS * HEAD_DIM:].view(KV_HEADS, HEAD_DIM)
        w["k_cache"][new_slot], w["v_cache"][new_slot] = k, v
        keys, values = w["k_cache"][slots], w["v_cache"][slots]  # [ctx, KV, D]
        group = Q_HEADS // KV_HEADS
        scores = torch.einsum("ghd,cgd->ghc", q.view(KV_HEADS, group, HEAD_DIM).float(), keys.float())
        probs = torch.softmax(scores / math.sqrt(HEAD_DIM), dim=-1)
        out = torch.einsum("ghc,cgd->ghd", probs, values.float()).to(q.dtype)
        seen["attn"] = out.reshape(ATTN)
        h = residual + F.linear(out.reshape(ATTN), w["o_w"])
        seen["xs_seen"] = norm(h, w["post_norm"])
        gate, up = F.linear(seen["xs_seen"], w["gate_up_w"]).chunk(2)
        seen["act"] = F.silu(gate) * up
        h = h + F.linear(seen["act"], w["down_w"])
    reference.seen = seen
    return norm(h, final_norm), h


def beside_solve(talker: torch.cuda.CUDAGraph, reps: int, kernels: str = "cublas") -> dict:
    """Ten talker steps (the graph) beside stand_in's matmuls on a stream of their own, replayed back to back:
    ms a talker step alone and beside, and the matmuls' passes a ms alone and while the talker ran (run 33g's
    first reading averaged the passes after the talker's end in: most of them, as it turned out)."""
    side, solve, alone = stand_in.alone(kernels)
    main_stream = torch.cuda.Stream()
    start, ends = stand_in.replay(main_stream, talker, reps)
    torch.cuda.synchronize()
    step_alone = start.elapsed_time(ends[-1]) / reps / 10
    n = 2 * max(1, round(reps * 10 * step_alone * alone / stand_in.PASSES))  # outlasts the talker's run
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    side.wait_event(origin)
    main_stream.wait_event(origin)
    solve_start, solve_ends = stand_in.replay(side, solve, n)
    talker_start, talker_ends = stand_in.replay(main_stream, talker, reps)
    torch.cuda.synchronize()
    talker_ms = origin.elapsed_time(talker_ends[-1])
    return {"beside": {"stand_in": kernels, "talker_ms_a_step_alone": round(step_alone, 4),
                       "talker_ms_a_step_beside": round(talker_start.elapsed_time(talker_ends[-1]) / reps / 10, 4),
                       "solve_passes_a_ms_alone": round(alone, 3),
                       "solve_passes_a_ms_beside": round(stand_in.passes_per_ms(origin, solve_ends, talker_ms), 3)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--context", type=int, default=700, help="keys in the cache, the new one included")
    ap.add_argument("--ctas", default="132,100")
    ap.add_argument("--depths", default="5")
    ap.add_argument("--splits", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20, help="graph replays of 10 steps")
    ap.add_argument("--consumers", type=int, default=CONSUMERS, help="consumer threads a CTA (and a producer warp)")
    ap.add_argument("--slot", type=int, default=SLOT, help="bytes a ring slot (whole rows of 896: 1792 each)")
    ap.add_argument("--no-math", action="store_true",
                    help="timing only: GEMV phases stream their weights but skip the arithmetic (wrong results)")
    ap.add_argument("--prefetch-kb", default="0",
                    help="how far (KB a CTA) each producer warp keeps L2 prefetches ahead of its copies; a list")
    ap.add_argument("--evict-first", action="store_true", help="the ring's copies marked evict-first in L2")
    ap.add_argument("--beside-solve", nargs="?", const="cublas", choices=("cublas", "triton"),
                    help="also time the steps beside a stand-in for token2wav's solve: stand_in.py's DiT-shaped "
                         "matmuls on cuBLAS (the default) or in small Triton tiles")
    ap.add_argument("--zero", default="", help="debugging: weights set to zero on both sides (o_w, down_w)")
    args = ap.parse_args()
    record = recorder(args.out)
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    page, eps, ctx = 16, 1e-6, args.context
    slots = -(-ctx // page) * page
    block_table = torch.randperm(slots // page, device=dev, dtype=torch.int32)  # pages in any order
    new_slot = int(block_table[(ctx - 1) // page]) * page + (ctx - 1) % page
    layers = []
    for _ in range(args.layers):
        layers.append({"in_norm": 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=bf),
                       "post_norm": 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=bf),
                       "qkv_w": 0.02 * torch.randn(QKV, HIDDEN, device=dev, dtype=bf),
                       "qkv_b": 0.02 * torch.randn(QKV, device=dev, dtype=bf),
                       "o_w": 0.02 * torch.randn(HIDDEN, ATTN, device=dev, dtype=bf),
                       "gate_up_w": 0.02 * torch.randn(2 * INTER, HIDDEN, device=dev, dtype=bf),
                       "down_w": 0.02 * torch.randn(HIDDEN, INTER, device=dev, dtype=bf),
                       "k_cache": torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=bf),
                       "v_cache": torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=bf)})
    for w in layers:
        for name in filter(None, args.zero.split(",")):
            w[name].zero_()
    final_norm = 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=bf)
    angle = (ctx - 1) / 10000 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM)
    cos = torch.cat([angle.cos(), angle.cos()]).to(bf)
    sin = torch.cat([angle.sin(), angle.sin()]).to(bf)
    h0 = torch.randn(HIDDEN, device=dev, dtype=bf)
    caches = [(w["k_cache"].clone(), w["v_cache"].clone()) for w in layers]
    want, want_h = reference(h0.clone(), layers, final_norm, cos, sin, ctx, page, block_table.long(), new_slot, eps)
    ref_caches = [(w["k_cache"].clone(), w["v_cache"].clone()) for w in layers]
    seen = reference.seen
    # the same layers in float32 (the cache as it was): how far bfloat16 rounding alone moves transformers' result
    exact = [{**{k: v.float() for k, v in w.items()}, "k_cache": kc.float(), "v_cache": vc.float()}
             for w, (kc, vc) in zip(layers, caches, strict=True)]
    want32, _ = reference(h0.float(), exact, final_norm.float(), cos.float(), sin.float(), ctx, page,
                          block_table.long(), new_slot, eps)
    del exact
    bf16_err = ((want.float() - want32).norm() / want32.norm()).item()
    seq_len = torch.tensor([ctx], device=dev, dtype=torch.int32)
    print(f"# {args.layers} layers, context {ctx}, reference done", flush=True)
    slot_t = torch.tensor([new_slot], device=dev, dtype=torch.int32)
    for ctas in (int(c) for c in args.ctas.split(",")):
        for depth, prefetch_kb in itertools.product((int(d) for d in args.depths.split(",")),
                                                    [int(k) for k in args.prefetch_kb.split(",")]):
            for w, (k, v) in zip(layers, caches, strict=True):  # the cache before the step
                w["k_cache"].copy_(k)
                w["v_cache"].copy_(v)
            step = PersistentTalker(layers, final_norm, ctas, depth, args.splits, page, eps, args.no_math,
                                    args.consumers, args.slot, prefetch_kb, args.evict_first)
            assert ctx <= step.max_context, (ctx, step.max_context)
            h, out = h0.clone(), torch.empty(HIDDEN, device=dev, dtype=bf)
            step(h, out, cos, sin, block_table, seq_len, slot_t)
            torch.cuda.synchronize()
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            err32 = ((out.float() - want32).norm() / want32.norm()).item()
            err_h = ((h.float() - want_h.float()).norm() / want_h.float().norm()).item()
            if args.layers == 1:  # each phase's output against transformers'
                for name in ("qkv", "attn", "xs_seen", "act"):
                    got, ref = step.scratch[name].float(), seen[name].float()
                    print(f"# {name}: rel err {((got - ref).norm() / ref.norm()).item():.2e}", flush=True)
                bad = ((step.scratch["act"].float() - seen["act"].float()).abs()
                       > 0.05 * seen["act"].float().abs() + 1e-3).nonzero().flatten().cpu()
                print(f"# act: {len(bad)} of {INTER} values more than 5% off", flush=True)
            err_k = max(((w["k_cache"].float() - rk.float()).abs().max()).item()
                        for w, (rk, _) in zip(layers, ref_caches, strict=True))
            again = h0.clone()
            for w, (k, v) in zip(layers, caches, strict=True):
                w["k_cache"].copy_(k)
                w["v_cache"].copy_(v)
            out2 = torch.empty_like(out)
            step(again, out2, cos, sin, block_table, seq_len, slot_t)
            same = bool(torch.equal(out, out2))
            # steps back to back in a CUDA graph (h keeps evolving; the time does not depend on its values)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(10):
                    step(h, out, cos, sin, block_table, seq_len, slot_t)
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 10)
            beside = beside_solve(graph, args.reps, args.beside_solve) if args.beside_solve else {}
            clocks = step.scratch["clocks"].view(-1, PHASES, 2).double().cpu()  # the last step's
            starts = torch.cat([clocks[:1, 0, 1] - 0, clocks.view(-1, 2)[:-1, 1]])  # previous phase's release
            work = (clocks.view(-1, 2)[:, 0] - starts).view(-1, PHASES)[1:].mean(0)  # layer 0 has no start
            wait = (clocks.view(-1, 2)[:, 1] - clocks.view(-1, 2)[:, 0]).view(-1, PHASES)[1:].mean(0)
            names = ("qkv", "attention", "merge", "o", "gate_up", "down")
            phase_us = {n: [round(float(w) / 1980, 2), round(float(x) / 1980, 2)]
                        for n, w, x in zip(names, work.tolist(), wait.tolist(), strict=True)}
            step.scratch["gemv_stats"].zero_()  # one more step: CTA 0's GEMV time waiting for slots, then working
            step(h, out, cos, sin, block_table, seq_len, slot_t)
            stats = (step.scratch["gemv_stats"].double().cpu() / 1980 / args.layers).view(4, 2).tolist()
            gemv_us = {n: [round(w, 2), round(k, 2)] for n, (w, k) in zip(("qkv", "o", "gate_up", "down"), stats,
                                                                          strict=True)}
            record(part="persistent_talker", ctas=ctas, depth=depth, no_math=args.no_math, consumers=args.consumers,
                   slot=args.slot, prefetch_kb=prefetch_kb, evict_first=args.evict_first,
                   cta0_us_work_then_wait=phase_us, cta0_gemv_us_slot_wait_then_work=gemv_us,
                   splits=args.splits, context=ctx,
                   layers=args.layers, ms_a_step=round(statistics.median(times), 4),
                   ms_min=round(min(times), 4), rel_err_out=f"{err:.2e}",
                   rel_err_out_vs_float32=f"{err32:.2e}", hf_bfloat16_vs_float32=f"{bf16_err:.2e}",
                   rel_err_hidden=f"{err_h:.2e}",
                   max_err_new_keys=f"{err_k:.2e}", same_bits_twice=same, smem_kb=step.smem // 1024, **beside)


if __name__ == "__main__":
    main()
