"""Gather throughput of one CTA on Hopper: cp.async against per-row TMA and register loads (issue 16).

The QSA split decode's producer takes 1.35 us to issue one 64-token tile of K and V (64 KB by cp.async,
benchmarks/results/NVIDIA_H200-2026-12-01-qsa-issue16-s16x.md), i.e. about 48 KB/us per SM, while the
tiles' bytes are a few percent of HBM bandwidth. This probe times the same gather alone, with the
sparse kernel's shape: `--producers` threads (whole warpgroups) fill a ring of `stages` tiles (64
random token rows of K and of V, D 256 BF16, from a paged pool), a consumer warpgroup runs the two
GEMMs of a tile on each stage and hands it back. Modes:

    cp      cp.async of 16 bytes (the sparse kernel's _gather_rows: 32 a producer thread a tile)
    cp4     cp, the tokens in random 4-token blocks (block_indices' pattern: 4 consecutive slots of a page)
    tma     a TMA load per 128-byte piece of a row into the 128-byte-swizzled tile wgmma reads (the
            TMA unit swizzles by shared-memory address, so a one-row box lands where wgmma expects
            it); one issuing thread a producer warp, 4 loads a row; a masked token would be an
            out-of-range coordinate, zero-filled by the TMA unit
    tma4    tma on 4-token blocks: one load a block and 128-byte piece (4 rows), a quarter of tma's loads
    ld      16-byte loads into registers, then 16-byte shared stores (no async copy: what a gather does
            without cp.async, e.g. a Triton program that loads a tile into registers)

Printed: us per call (CUDA-graph replay, L2 flushed) for CTA counts and tiles per CTA, and the
gathered bytes per us per CTA. H200 results and what they decided (eight producer warps for wide=0,
no per-row TMA): benchmarks/results/NVIDIA_H200-2026-12-01-qsa-gather-probe.md; `ld`:
benchmarks/results/NVIDIA_H200-2026-12-02-qsa-ring-ldg.md.

    python benchmarks/experiments/gather_probe.py [--modes cp cp4 tma tma4 ld] [--ctas 22 66 132 264] [--tiles 1 3 8 33]
                                      [--stages 1 2 3] [--producers 128 256] [--pool-pages 8192]
"""

import argparse

import tilelang
import tilelang.language as T

TILE, DIM = 64, 256
PRODUCER_BARRIER = 3
NO_COMMIT_WAIT = "parallel_async_without_async_commit_wait"
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True, "tl.disable_safe_memory_legalize": True}


def gather_program(mode, stages, producers=128):
    P, PS, N, NTOK = T.dynamic("P PS N NTOK")
    dtype = "bfloat16"

    @T.prim_func
    def main(
        K: T.Tensor((P, PS, 1, DIM), dtype),
        V: T.Tensor((P, PS, 1, DIM), dtype),
        IDX: T.Tensor((N, NTOK), "int32"),
        Q: T.Tensor((16, DIM), dtype),
        OUT: T.Tensor((N, DIM, 16), "float32"),
    ):
        with T.Kernel(N, threads=producers + 128) as bx:
            Ks = T.alloc_shared((stages, TILE, DIM), dtype)
            Vs = T.alloc_shared((stages, TILE, DIM), dtype)
            Qs = T.alloc_shared((16, DIM), dtype)
            Ps = T.alloc_shared((TILE, 16), dtype)
            pg = T.alloc_shared((TILE,), "int32")
            sl = T.alloc_shared((TILE,), "int32")
            S = T.alloc_fragment((TILE, 16), "float32")
            acc = T.alloc_fragment((DIM, 16), "float32")
            full = T.alloc_barrier([2 * producers if mode.startswith("cp") else producers] * stages)
            empty = T.alloc_barrier([128] * stages)
            tx = T.get_thread_binding()
            warps = producers // 32  # a producer warp's rows of a tile: TILE // warps
            regs = T.alloc_local((TILE // warps * 8,), dtype)  # ld: a producer thread's loads of a tile's K or V
            n_tiles = NTOK // TILE
            if tx < producers:
                for it in T.serial(n_tiles):
                    st = it % stages
                    T.sync_threads(PRODUCER_BARRIER, producers)
                    if tx < TILE:
                        t = IDX[bx, it * TILE + tx]
                        pg[tx] = t // PS
                        sl[tx] = t % PS
                    T.sync_threads(PRODUCER_BARRIER, producers)
                    T.barrier_wait(empty[st], ((it // stages) & 1) ^ 1)
                    if mode in ("cp", "cp4"):
                        for k, d in T.Parallel(TILE, DIM, prefer_async=True, annotations={NO_COMMIT_WAIT: True}):
                            Ks[st, k, d] = K[pg[k], sl[k], 0, d]
                        for k, d in T.Parallel(TILE, DIM, prefer_async=True, annotations={NO_COMMIT_WAIT: True}):
                            Vs[st, k, d] = V[pg[k], sl[k], 0, d]
                        T.cp_async_barrier_noinc(full[st])
                    elif mode == "ld":
                        # a warp a row at a time, 16 bytes a lane: every load of K (then of V) is in flight
                        # before the first store
                        for X, Xs in ((K, Ks), (V, Vs)):
                            for i in T.unroll(TILE // warps):
                                for e in T.vectorized(8):
                                    regs[i * 8 + e] = X[pg[i * warps + tx // 32], sl[i * warps + tx // 32], 0, tx % 32 * 8 + e]
                            for i in T.unroll(TILE // warps):
                                for e in T.vectorized(8):
                                    Xs[st, i * warps + tx // 32, tx % 32 * 8 + e] = regs[i * 8 + e]
                        T.fence_proxy_async()  # generic-proxy stores, read by wgmma
                    elif mode == "tma4":
                        # a 4-token block is 4 consecutive slots of one page: one box of 4 rows x 128 bytes
                        for r in T.serial(TILE // warps // 4):
                            k = (tx // 32) * (TILE // warps) + 4 * r
                            for c in T.unroll(DIM // 64):
                                T.tma_copy(K[pg[k], sl[k]:sl[k] + 4, 0, c * 64:(c + 1) * 64], Ks[st, k:k + 4, c * 64:(c + 1) * 64],
                                           barrier=full[st], leader_scope_threads=32)
                            for c in T.unroll(DIM // 64):
                                T.tma_copy(V[pg[k], sl[k]:sl[k] + 4, 0, c * 64:(c + 1) * 64], Vs[st, k:k + 4, c * 64:(c + 1) * 64],
                                           barrier=full[st], leader_scope_threads=32)
                    else:
                        for r in T.serial(TILE // warps):
                            k = (tx // 32) * (TILE // warps) + r
                            for c in T.unroll(DIM // 64):
                                T.tma_copy(K[pg[k], sl[k], 0, c * 64:(c + 1) * 64], Ks[st, k, c * 64:(c + 1) * 64],
                                           barrier=full[st], leader_scope_threads=32)
                            for c in T.unroll(DIM // 64):
                                T.tma_copy(V[pg[k], sl[k], 0, c * 64:(c + 1) * 64], Vs[st, k, c * 64:(c + 1) * 64],
                                           barrier=full[st], leader_scope_threads=32)
                    T.barrier_arrive(full[st])
            else:
                T.copy(Q, Qs)
                T.fill(acc, 0)
                for it in T.serial(n_tiles):
                    st = it % stages
                    T.barrier_wait(full[st], (it // stages) & 1)
                    T.fence_proxy_async()
                    T.gemm(Ks[st, :, :], Qs, S, transpose_B=True, clear_accum=True)
                    T.copy(S, Ps)
                    T.fence_proxy_async()  # generic-proxy writes of Ps, read by wgmma
                    T.sync_threads(1, 128)
                    T.gemm(Vs[st, :, :], Ps, acc, transpose_A=True)
                    T.barrier_arrive(empty[st])
                T.copy(acc, OUT[bx, :, :])

    return main


def compile_probe(mode, stages, producers=128):
    return tilelang.compile(gather_program(mode, stages, producers), target={"kind": "cuda", "arch": "sm_90a"},
                            pass_configs=PASS_CONFIGS)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, nargs="+", default=[22, 66, 132, 264])
    ap.add_argument("--tiles", type=int, nargs="+", default=[1, 3, 8, 33])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--modes", nargs="+", default=["cp", "tma"])
    ap.add_argument("--producers", type=int, nargs="+", default=[128], help="producer threads (a multiple of 128)")
    ap.add_argument("--pool-pages", type=int, default=8192, help="64-token pages of K and of V (8192: 2 x 268 MB)")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    kernels = {(m, s, p): compile_probe(m, s, p) for m in args.modes for s in args.stages for p in args.producers}
    if args.compile_only:
        return
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
    from common import cold_graph_us

    torch.manual_seed(0)
    pages, ps = args.pool_pages, 64
    K = torch.randn(pages, ps, 1, DIM, device="cuda", dtype=torch.bfloat16)
    V = torch.randn_like(K)
    Q = torch.randn(16, DIM, device="cuda", dtype=torch.bfloat16)

    def expected(idx):  # the two GEMMs of every tile, S rounded to BF16 as the kernel's P tile
        kk, vv = K.view(-1, DIM)[idx.long()].float(), V.view(-1, DIM)[idx.long()].float()
        return torch.einsum("ntd,nth->ndh", vv, torch.einsum("ntd,hd->nth", kk, Q.float()).bfloat16().float())

    print(f"{'mode':>4} {'st':>2} {'prod':>4} {'ctas':>4} {'tiles':>5} {'us':>8} {'KB/us/CTA':>9} {'TB/s':>6} {'err':>8}")
    for n in args.ctas:
        for nt in args.tiles:
            rows = torch.randint(0, pages * ps, (n, nt * TILE), device="cuda", dtype=torch.int32)
            blocks = (torch.randint(0, pages * ps // 4, (n, nt * TILE // 4, 1), device="cuda", dtype=torch.int32) * 4
                      + torch.arange(4, device="cuda", dtype=torch.int32)).view(n, nt * TILE)
            refs = {}
            for (m, st, pr), ker in kernels.items():
                blocked = m.endswith("4")  # cp4, tma4: the 4-token blocks
                idx = blocks if blocked else rows
                if blocked not in refs:
                    refs[blocked] = expected(idx)
                ref = refs[blocked]
                out = torch.full((n, DIM, 16), float("nan"), device="cuda")
                ker(K, V, idx, Q, out)
                err = float((out - ref).norm() / ref.norm())
                us = cold_graph_us(lambda: ker(K, V, idx, Q, out))
                kb = nt * TILE * DIM * 2 * 2 / 1024
                print(f"{m:>4} {st:>2} {pr:>4} {n:>4} {nt:>5} {us:8.2f} {kb / us:9.1f} {n * kb * 1024 / us / 1e6:6.2f} {err:8.1e}",
                      flush=True)


if __name__ == "__main__":
    main()
