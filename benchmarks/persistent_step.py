"""What a batch-1 talker step could cost as one persistent kernel: a ceiling probe, not a talker.

The talker's code takes ~1.12 ms on an H200 (benchmarks/results/omni_qwen2_5.md) to read 2.65 GB of weights that
need ~0.62 ms at the memory's bandwidth: ~200 kernels a code each pay a few µs to launch, ramp up and drain
(run 29's fit). A persistent kernel pays a grid barrier at each dependency instead, and since weights never
depend on activations, each SM's weight stream can run ahead through the barriers in a shared-memory ring while
only the arithmetic waits for them. This probe measures that design's ceiling with the released talker's bytes:
24 layers of qkv (4.6 MB), o (2.75 MB), gate-up (67.9 MB) and down (33.9 MB), each read once a step, split
evenly over one CTA per SM; six grid barriers a layer (after qkv, attention, its merge, o, gate-up and down: the
talker's dependencies, attention and merge carrying no weights); after each barrier a CTA reads the phase's input
vector (896 to 18944 values) from global memory, as a real kernel must. Each thread multiplies the weights it
copied with the input values they meet and keeps a running sum; a phase ends with a block reduction and a store.
The arithmetic is not the talker's (no per-row sums, norms, rotary or softmax), so the figure is a floor for
this design, not a talker kernel.

Two designs. `ring`: every thread copies its 16 B of a chunk with cp.async, `depth` chunks ahead, and reads
back only what it copied. `producer_warp`: one extra warp streams each CTA's weights phase after phase with bulk
copies (cp.async.bulk, an mbarrier a ring slot), whatever the barriers, while the other warps wait at them and
compute (16 B a consumer thread, or 32 B with `_32b`). Rows: ring depth, CTAs (132 = the whole H200; 100 and 66 as
if the talker held part of the GPU), with the barriers, without them, and one flat stream of the same bytes.

    python benchmarks/persistent_step.py --out persistent.jsonl     # GPU with CuPy (its NVRTC compiles the kernel)
"""

from __future__ import annotations

import argparse
import statistics

from recording import recorder

LAYERS = 24
HIDDEN, INTER, QKV, ATTN = 896, 18944, 2560, 1536
# (phase, weight rows, input width); attention and its merge read no weights
PHASES = [("qkv", QKV, HIDDEN), ("attention", 0, 0), ("merge", 0, 0), ("o", HIDDEN, ATTN),
          ("gate_up", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER)]
THREADS = 512
CHUNK = THREADS * 16  # bytes a CTA copies per pipeline step

SOURCE = r"""
#include <cuda_bf16.h>

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void grid_barrier(unsigned* count, volatile unsigned* generation, unsigned ctas) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned seen = *generation;
        __threadfence();
        if (atomicAdd(count, 1u) == ctas - 1) {
            *count = 0;
            __threadfence();
            atomicAdd((unsigned*)generation, 1u);
        } else {
            while (*generation == seen) { }
        }
        __threadfence();
    }
    __syncthreads();
}

// phases: per phase of a step, [chunks per CTA, input width, barrier after (0/1)]; offsets: its weights' first
// byte (CTA c reads chunks*CHUNK bytes from offset + c*chunks*CHUNK)
extern "C" __global__ void __launch_bounds__(THREADS, 1)
persistent_step(const char* __restrict__ weights, const long long* __restrict__ offsets,
                const int* __restrict__ phases, int num_phases, float* acts, unsigned* barrier, int use_barriers) {
    extern __shared__ __align__(16) char smem[];
    __nv_bfloat16* x = reinterpret_cast<__nv_bfloat16*>(smem);              // the phase's input, up to MAX_WIDTH
    char* ring = smem + MAX_WIDTH * 2;                                       // DEPTH chunks
    __shared__ float partial[THREADS / 32];
    const int tid = threadIdx.x;
    const unsigned ctas = gridDim.x;

    // the CTA's flat list of chunks: phase by phase
    int phase = 0, in_phase = 0;
    int issue_phase = 0, issue_in = 0;
    auto issue = [&](int slot) {
        while (issue_phase < num_phases && issue_in >= phases[3 * issue_phase]) { issue_phase++; issue_in = 0; }
        if (issue_phase < num_phases) {
            const int chunks = phases[3 * issue_phase];
            const char* src = weights + offsets[issue_phase] + ((long long)blockIdx.x * chunks + issue_in) * CHUNK
                              + tid * 16;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_addr(ring + slot * CHUNK + tid * 16)),
                         "l"(src));
            issue_in++;
        }
        asm volatile("cp.async.commit_group;");
    };
    for (int s = 0; s < DEPTH; s++) issue(s);

    float acc = 0.f;
    int slot = 0;
    for (phase = 0; phase < num_phases; phase++) {
        const int chunks = phases[3 * phase], width = phases[3 * phase + 1];
        if (width > 0) {  // the input, written before the last barrier
            const uint4* src = reinterpret_cast<const uint4*>(acts + 4096) + (phase % 2) * (MAX_WIDTH / 8);
            for (int i = tid; i < width / 8; i += THREADS) reinterpret_cast<uint4*>(x)[i] = src[i];
            __syncthreads();
        }
        for (in_phase = 0; in_phase < chunks; in_phase++) {
            asm volatile("cp.async.wait_group %0;" :: "n"(DEPTH - 1));
            const uint4 w = *reinterpret_cast<const uint4*>(ring + slot * CHUNK + tid * 16);
            // the 8 weights meet inputs k..k+7 (every width is a multiple of 8)
            const int k = (int)((unsigned)(in_phase * (CHUNK / 2) + tid * 8) % (unsigned)width);
            const uint4 xv = *reinterpret_cast<const uint4*>(x + k);
            const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
            const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 wf = __bfloat1622float2(w2[j]), xf = __bfloat1622float2(x2[j]);
                acc += wf.x * xf.x + wf.y * xf.y;
            }
            issue(slot);
            slot = slot + 1 == DEPTH ? 0 : slot + 1;
        }
        // the phase's output: a block sum, stored where the next phase reads (a real kernel writes its rows)
        float v = acc;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if ((tid & 31) == 0) partial[tid >> 5] = v;
        __syncthreads();
        if (tid == 0) {
            float total = 0.f;
            for (int w = 0; w < THREADS / 32; w++) total += partial[w];
            acts[blockIdx.x] = total;
        }
        if (phases[3 * phase + 2] && use_barriers) grid_barrier(barrier, barrier + 32, ctas);
        else __syncthreads();
    }
    asm volatile("cp.async.wait_group 0;");
}
"""

# A ring slot filled by one bulk copy (cp.async.bulk) and guarded by two mbarriers (full: its bytes landed; empty:
# every consumer warp is done with it). Also compiled into persistent_talker.py's kernel.
BULK_RING = r"""
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
    asm volatile("{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT;\n}\n" :: "r"(smem_addr(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(b)) : "memory");
}
// the same copy, telling L2 to drop the bytes first (they are read once a step): keeps prefetched bytes in L2
__device__ __forceinline__ void bulk_copy_evict_first(void* dst, const void* src, unsigned bytes,
                                                      unsigned long long* b) {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1], %2, [%3], %4;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(b)), "l"(policy) : "memory");
}
// a hint, nothing waits for it: the bytes into L2, so a later bulk copy of them does not wait for the memory
__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(src), "r"(bytes) : "memory");
}
"""

SPECIALIZED = r"""
#include <cuda_bf16.h>
""" + BULK_RING + r"""
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" :: "n"(THREADS) : "memory"); }

// release/acquire atomics at GPU scope: the arrival publishes this CTA's stores, the generation's change
// makes every CTA's visible
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* generation, unsigned ctas) {
    consumers_sync();
    if (threadIdx.x == 0) {
        unsigned seen, old, now;
        asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(generation) : "memory");
        asm volatile("atom.add.release.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
        if (old == ctas - 1) {
            asm volatile("st.relaxed.gpu.u32 [%0], 0;" :: "l"(count) : "memory");
            asm volatile("atom.add.release.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(generation) : "memory");
        } else {
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(generation) : "memory");
            } while (now == seen);
        }
    }
    consumers_sync();
}

// One producer warp streams the CTA's weights through the ring with bulk copies, phase after phase, whatever
// the barriers; THREADS consumer threads wait at the barriers and compute. Same table and arithmetic as
// persistent_step.
extern "C" __global__ void __launch_bounds__(THREADS + 32, 1)
specialized_step(const char* __restrict__ weights, const long long* __restrict__ offsets,
                 const int* __restrict__ phases, int num_phases, float* acts, unsigned* barrier, int use_barriers) {
    extern __shared__ __align__(128) char smem[];
    __nv_bfloat16* x = reinterpret_cast<__nv_bfloat16*>(smem);
    char* ring = smem + MAX_WIDTH * 2;
    __shared__ __align__(8) unsigned long long full[DEPTH], empty[DEPTH];
    __shared__ float partial[THREADS / 32];
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < DEPTH; s++) { mbar_init(&full[s], 1); mbar_init(&empty[s], THREADS / 32); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid >= THREADS) {
        if (tid == THREADS) {
            int i = 0;
            for (int p = 0; p < num_phases; p++) {
                const int chunks = phases[3 * p];
                const char* base = weights + offsets[p] + (long long)blockIdx.x * chunks * CHUNK;
                for (int c = 0; c < chunks; c++, i++) {
                    const int slot = i % DEPTH;
                    mbar_wait(&empty[slot], ((i / DEPTH) & 1) ^ 1);
                    mbar_expect_tx(&full[slot], CHUNK);
                    bulk_copy(ring + slot * CHUNK, base + (long long)c * CHUNK, CHUNK, &full[slot]);
                }
            }
        }
        return;
    }
    float acc = 0.f;
    int i = 0;
    for (int p = 0; p < num_phases; p++) {
        const int chunks = phases[3 * p], width = phases[3 * p + 1];
        if (width > 0) {
            const uint4* src = reinterpret_cast<const uint4*>(acts + 4096) + (p % 2) * (MAX_WIDTH / 8);
            for (int j = tid; j < width / 8; j += THREADS) reinterpret_cast<uint4*>(x)[j] = src[j];
            consumers_sync();
        }
        for (int c = 0; c < chunks; c++, i++) {
            const int slot = i % DEPTH;
            mbar_wait(&full[slot], (i / DEPTH) & 1);
            uint4 w[PER_THREAD / 16];
            #pragma unroll
            for (int q = 0; q < PER_THREAD / 16; q++)
                w[q] = *reinterpret_cast<const uint4*>(ring + slot * CHUNK + tid * PER_THREAD + q * 16);
            __syncwarp();
            if ((tid & 31) == 0) mbar_arrive(&empty[slot]);
            const int k = (int)((unsigned)(c * (CHUNK / 2) + tid * (PER_THREAD / 2)) % (unsigned)width);
            #pragma unroll
            for (int q = 0; q < PER_THREAD / 16; q++) {
                const uint4 xv = *reinterpret_cast<const uint4*>(x + k + 8 * q);
                const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w[q]);
                const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
                #pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 wf = __bfloat1622float2(w2[j]), xf = __bfloat1622float2(x2[j]);
                    acc += wf.x * xf.x + wf.y * xf.y;
                }
            }
        }
        float v = acc;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if ((tid & 31) == 0) partial[tid >> 5] = v;
        consumers_sync();
        if (tid == 0) {
            float total = 0.f;
            for (int w = 0; w < THREADS / 32; w++) total += partial[w];
            acts[blockIdx.x] = total;
        }
        if (phases[3 * p + 2] && use_barriers) grid_barrier(barrier, barrier + 32, gridDim.x);
        else consumers_sync();
    }
}
"""


def timed(kernel, ctas: int, threads: int, smem: int, reps: int, params: tuple) -> float:
    """Median ms of one launch (after three)."""
    import cupy as cp

    def launch():
        kernel((ctas,), (threads,), params, shared_mem=smem)

    for _ in range(3):
        launch()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def main() -> None:
    import cupy as cp
    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--depths", default="8,16,20")
    ap.add_argument("--ctas", default="132,100,66", help="CTAs (one a SM): the whole H200, and partitions of it")
    ap.add_argument("--designs", default="ring,producer_warp,producer_warp_32b")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    record = recorder(args.out)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    max_width = max(w for _, _, w in PHASES)
    acts = cp.zeros(4096 + max_width, dtype=cp.float32)
    acts[4096:] = cp.random.random(max_width, dtype=cp.float32) * 1e-3
    barrier = cp.zeros(64, dtype=cp.uint32)
    designs = {"ring": (SOURCE, "persistent_step", THREADS, 0),  # name: (source, kernel, consumers, producer warp)
               "producer_warp": (SPECIALIZED, "specialized_step", THREADS, 32),
               "producer_warp_32b": (SPECIALIZED, "specialized_step", THREADS // 2, 32)}
    kernels = {}

    def kernel_for(design: str, depth: int):
        if (design, depth) not in kernels:
            source, name, consumers, producer = designs[design]
            options = ("-std=c++17", f"-DTHREADS={consumers}", f"-DPER_THREAD={CHUNK // consumers}",
                       f"-DCHUNK={CHUNK}", f"-DDEPTH={depth}", f"-DMAX_WIDTH={max_width}")
            module = cp.RawModule(code=source, options=options,
                                  enable_cooperative_groups=True)  # launched so that every CTA is resident
            kernel = module.get_function(name)
            kernel.max_dynamic_shared_size_bytes = max_width * 2 + depth * CHUNK
            kernels[design, depth] = kernel, consumers + producer
        return kernels[design, depth]

    for ctas in (int(c) for c in args.ctas.split(",")):
        # per phase: chunks per CTA (weights padded up to whole chunks); one buffer holds every layer's weights
        table, offsets, total = [], [], 0
        for _layer in range(LAYERS):
            for _, rows, width in PHASES:
                chunks = -(-rows * width * 2 // (ctas * CHUNK)) if rows else 0
                table.append((chunks, width, 1))
                offsets.append(total)
                total += chunks * ctas * CHUNK
        weights = cp.random.random(total // 2, dtype=cp.float32).astype(cp.float16).view(cp.uint8)  # 2-byte values
        phases = cp.asarray(np.array(table, dtype=np.int32).ravel())
        offs = cp.asarray(np.array(offsets, dtype=np.int64))
        # one phase over every byte, no barrier: the bandwidth alone (with the same arithmetic)
        flat = cp.asarray(np.array([(total // (ctas * CHUNK), HIDDEN, 0)], dtype=np.int32)), cp.zeros(1, cp.int64)
        print(f"# {ctas} of {sms} SMs, {total / 1e9:.3f} GB a step over {len(table)} phases", flush=True)

        for depth in (int(d) for d in args.depths.split(",")):
            smem = max_width * 2 + depth * CHUNK
            for design in args.designs.split(","):
                kernel, threads = kernel_for(design, depth)
                step = (weights, offs, phases, np.int32(len(table)), acts, barrier)
                row = {"design": design, "ctas": ctas, "depth": depth, "ring_kb": depth * CHUNK // 1024,
                       "gb": round(total / 1e9, 3),
                       "ms_barriers": timed(kernel, ctas, threads, smem, args.reps, (*step, np.int32(1))),
                       "ms_no_barriers": timed(kernel, ctas, threads, smem, args.reps, (*step, np.int32(0))),
                       "ms_flat_stream": timed(kernel, ctas, threads, smem, args.reps,
                                               (weights, flat[1], flat[0], np.int32(1), acts, barrier, np.int32(0)))}
                row["tb_s_barriers"] = round(total / row["ms_barriers"] / 1e9, 2)
                row["tb_s_flat"] = round(total / row["ms_flat_stream"] / 1e9, 2)
                for key in ("ms_barriers", "ms_no_barriers", "ms_flat_stream"):
                    row[key] = round(row[key], 4)
                record(part="persistent_step", barriers_a_step=LAYERS * 6, **row)
        del weights

if __name__ == "__main__":
    main()
