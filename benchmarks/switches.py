"""Kernel A/B switches as benchmark flags: each sets one of the package's module settings in this process (so
they reach stages that run inline here, not stage workers in processes of their own).

    --no-fused-draw     omnistage.kernels.draw.ENABLED = False        (torch's draw everywhere)
    --no-pdl            omnistage.kernels.pdl.set_enabled(False)      (no programmatic dependent launch)
    --no-skinny-preload omnistage.kernels.skinny_gemm.PRELOAD = False (decode GEMMs' K loop after the PDL wait)
    --decode-splits N   omnistage.kernels.paged_attention.MAX_SPLITS = N
    --no-exact-gemm     omnistage.kernels.exact_gemm.ENABLED = False  (cuBLAS for float32 DiT matmuls)
"""

from __future__ import annotations

import argparse


def add_kernel_switches(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("kernel A/B switches (this process's module settings: inline stages only)")
    group.add_argument("--no-fused-draw", action="store_true", help="omnistage.kernels.draw.ENABLED = False")
    group.add_argument("--no-pdl", action="store_true", help="omnistage.kernels.pdl.set_enabled(False)")
    group.add_argument("--no-skinny-preload", action="store_true",
                       help="omnistage.kernels.skinny_gemm.PRELOAD = False")
    group.add_argument("--decode-splits", type=int, metavar="N",
                       help="omnistage.kernels.paged_attention.MAX_SPLITS = N (default 32)")
    group.add_argument("--no-exact-gemm", action="store_true", help="omnistage.kernels.exact_gemm.ENABLED = False")


def apply_kernel_switches(args: argparse.Namespace) -> dict:
    """Sets the module settings the flags ask for; returns those changed (for the result rows)."""
    from omnistage.kernels import draw, exact_gemm, paged_attention, pdl, skinny_gemm

    changed = {}
    if args.no_fused_draw:
        draw.ENABLED = changed["fused_draw"] = False
    if args.no_pdl:
        pdl.set_enabled(False)
        changed["pdl"] = False
    if args.no_skinny_preload:
        skinny_gemm.PRELOAD = changed["skinny_preload"] = False
    if args.decode_splits:
        paged_attention.MAX_SPLITS = changed["decode_splits"] = args.decode_splits
    if args.no_exact_gemm:
        exact_gemm.ENABLED = changed["exact_gemm"] = False
    return changed
