"""What a batch-1 talker step could cost as one persistent kernel: a ceiling probe, not a talker.

The talker's code takes ~1.12 ms on an H200 (benchmarks/results/omni_qwen2_5.md) to read 2.65 GB of weights that
need ~0.62 ms at the memory's bandwidth: ~200 kernels a code each pay a few µs to launch, ramp up and drain
(run 29's fit). A persistent kernel pays a grid barrier at each dependency instead, and since weights never
depend on activations, each SM's weight stream can run ahead through the barriers in a shared-memory ring while
only the arithmetic waits for them. This probe measures that design's ceiling with the released talker's bytes:
24 layers of qkv (4.6 MB), o (2.75 MB), gate-up (67.9 MB) and down (33.9 MB), each read once a step, split
evenly over one CTA per SM; six grid barriers a layer (after qkv, attention, its merge, o, gate-up and down: the
talker's dependencies, attention and merge carrying no weights); after each barrier a CTA reads the phase's input
vector (896 to 18944 values) from global memory, as a real kernel must. Each thread multiplies the 8 weights it
copied with the input values they meet and keeps a running sum; a phase ends with a block reduction and a store.
The arithmetic is not the talker's (no per-row sums, norms, rotary or softmax), so the figure is a floor for
this design, not a talker kernel.

Rows: `depth` chunks of 16 B per thread in flight (cp.async into the ring: 2 = no run-ahead worth the name), with
and without the barriers, and one flat stream of the same bytes (the bandwidth alone).

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
            const int k = (int)(((long long)in_phase * CHUNK + tid * 16) / 2 % width);
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


def main() -> None:
    import cupy as cp
    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--depths", default="2,4,8,16,20")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    record = recorder(args.out)
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    max_width = max(w for _, _, w in PHASES)

    # per phase: chunks per CTA (weights padded up to whole chunks); one buffer holds every layer's weights
    table, offsets, total = [], [], 0
    for _layer in range(LAYERS):
        for _, rows, width in PHASES:
            chunks = -(-rows * width * 2 // (sms * CHUNK)) if rows else 0
            table.append((chunks, width, 1))
            offsets.append(total)
            total += chunks * sms * CHUNK
    weights = cp.random.random(total // 2, dtype=cp.float32).astype(cp.float16).view(cp.uint8)  # any 2-byte values
    assert weights.nbytes == total
    acts = cp.zeros(4096 + max_width, dtype=cp.float32)
    acts[4096:] = cp.random.random(max_width, dtype=cp.float32) * 1e-3
    barrier = cp.zeros(64, dtype=cp.uint32)
    phases = cp.asarray(np.array(table, dtype=np.int32).ravel())
    offs = cp.asarray(np.array(offsets, dtype=np.int64))
    print(f"# {sms} SMs, {total / 1e9:.3f} GB a step over {len(table)} phases", flush=True)

    def timed(kernel, smem: int, use_barriers: int, phase_table, offset_table, n: int) -> float:
        def launch():
            kernel((sms,), (THREADS,), (weights, offset_table, phase_table, np.int32(n), acts, barrier,
                                        np.int32(use_barriers)), shared_mem=smem)
        for _ in range(3):
            launch()
        times = []
        for _ in range(args.reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            launch()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        return statistics.median(times)

    for depth in (int(d) for d in args.depths.split(",")):
        smem = max_width * 2 + depth * CHUNK
        module = cp.RawModule(code=SOURCE, options=("-std=c++17", f"-DTHREADS={THREADS}", f"-DCHUNK={CHUNK}",
                                                    f"-DDEPTH={depth}", f"-DMAX_WIDTH={max_width}"),
                              enable_cooperative_groups=True)  # launched so that every CTA is resident
        kernel = module.get_function("persistent_step")
        kernel.max_dynamic_shared_size_bytes = smem
        row = {"depth": depth, "ring_kb": depth * CHUNK // 1024, "gb": round(total / 1e9, 3)}
        row["ms_barriers"] = timed(kernel, smem, 1, phases, offs, len(table))
        row["ms_no_barriers"] = timed(kernel, smem, 0, phases, offs, len(table))
        # one phase over every byte, no barrier: the bandwidth alone (with the same arithmetic)
        flat_table = cp.asarray(np.array([(total // (sms * CHUNK), HIDDEN, 0)], dtype=np.int32))
        row["ms_flat_stream"] = timed(kernel, smem, 0, flat_table, cp.zeros(1, dtype=cp.int64), 1)
        row["tb_s_barriers"] = round(total / row["ms_barriers"] / 1e9, 2)
        row["tb_s_flat"] = round(total / row["ms_flat_stream"] / 1e9, 2)
        for key in ("ms_barriers", "ms_no_barriers", "ms_flat_stream"):
            row[key] = round(row[key], 4)
        record(part="persistent_step", barriers_a_step=LAYERS * 6, **row)


if __name__ == "__main__":
    main()
