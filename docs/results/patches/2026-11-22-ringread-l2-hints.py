"""Readers shaped like the tensor-core GEMV: G CTAs x W warps, each warp streaming its own region through
a ring of S stages of C bytes in shared memory (cp.async by all lanes, or one bulk copy per stage)."""
import sys, os, numpy as np
sys.path.insert(0, '.')
from ptx_gen.catalog import kernel
from realizar import cuda
from realizar.layers import LayerOps
from tools.bench_gemv import time_launches, n_copies, _pdl

@kernel("ringread_scratch", grid=[{"mode": "cp", "warps": 8, "stages": 2, "chunk": 4096, "steps": 8}])
def ringread(m, mode="cp", warps=8, stages=2, chunk=4096, steps=8, rb=0):
    k = m.kernel(f"ringread_{mode}_w{warps}_s{stages}_c{chunk}_n{steps}_rb{rb}", [("w", "u64"), ("out", "u64")])
    k.max_threads = 32 * warps
    H = {}
    if os.environ.get("RPF"): H["prefetch"] = os.environ["RPF"]
    if os.environ.get("REF"): H["policy"] = k.create_policy("evict_first")
    k.meta.update(block=32 * warps, dyn_smem=warps * stages * chunk + warps * stages * 8)
    w = k.global_ptr("w")
    tid = k.tid(); lane = k.and_(tid, 31); warp = k.shr(tid, 5)
    gw = k.add(k.mul(k.ctaid(), warps), warp)
    base = k.add(w, k.mul_wide(gw, steps * chunk))
    smem = k.dynamic_shared()
    ring = k.add(smem, k.mul(warp, stages * chunk))
    acc = k.var("u32", 0)
    if mode == "bulk":
        mbar = k.add(smem, k.add(k.mul(warp, 8 * stages), warps * stages * chunk))
        lane0 = k.setp("eq", lane, 0)
        for i in range(stages):
            k.mbarrier_init(k.add(mbar, 8 * i), 1, pred=lane0)
        k.fence_mbarrier_init(); k.bar_warp_sync()
    def issue(j, valid):
        slot = k.rem(j, stages) if not isinstance(j, int) else j % stages
        dst = k.add(ring, k.mul(slot, chunk)) if not isinstance(slot, int) else k.add(ring, slot * chunk)
        src = k.add(base, k.mul_wide(j, chunk) if not isinstance(j, int) else j * chunk)
        if mode == "bulk":
            mb = k.add(mbar, k.shl(slot, 3)) if not isinstance(slot, int) else k.add(mbar, 8 * slot)
            p = k.both(lane0, valid)
            k.mbarrier_expect_tx(mb, chunk, pred=p)
            k.cp_async_bulk(dst, src, chunk, mb, pred=p)
        elif mode == "cta":  # the CTA's step: 32 rows x 1152 B (8 units), 9 chunks a thread, 512 B a warp-instruction
            jj = j if not isinstance(j, int) else k.mov(j, "u32")
            sl = k.rem(jj, stages)
            for q in range(9):
                cid = k.add(tid, 256 * q) if q else tid
                row = k.div(cid, 72); c16 = k.sub(cid, k.mul(row, 72))
                off = k.add(k.mul_wide(k.add(k.mul(k.ctaid(), 32), row), rb), k.mul_wide(k.add(k.mul(jj, 1152), k.shl(c16, 4)), 1))
                d = k.add(smem, k.add(k.mul(sl, 36864), k.shl(cid, 4)))
                k.cp_async(d, k.add(w, off), pred=valid, **H)
            k.cp_async_commit()
        elif mode in ("gemv", "tiled"):  # chunk = 32 rows x 144 B; warp = K part
            P = chunk // 32  # bytes of a row a stage
            for q in range(chunk // 512):
                c = k.add(lane, 32 * q) if q else lane
                d = k.add(dst, k.shl(c, 4))
                if mode == "gemv":
                    row = k.div(c, P // 16); col = k.sub(c, k.mul(row, P // 16))
                    off = k.add(k.mul_wide(k.add(k.mul(k.ctaid(), 32), row), rb), k.mul_wide(k.add(k.mul(col, 16), k.mul(k.mad(j if not isinstance(j, int) else k.mov(j, "u32"), warps, warp), P)), 1))
                else:
                    tile = k.add(k.mul(k.ctaid(), rb // 144), k.mad(j if not isinstance(j, int) else k.mov(j, "u32"), warps, warp))
                    off = k.add(k.mul_wide(tile, 4608), k.cvt(k.shl(c, 4), "u64"))
                k.cp_async(d, k.add(w, off), pred=valid, **H)
            k.cp_async_commit()
        else:
            d = k.add(dst, k.shl(lane, 4)); s = k.add(src, k.cvt(k.shl(lane, 4), "u64"))
            for q in range(chunk // 512):
                k.cp_async(d, s, pred=valid, dst_offset=512 * q, src_offset=512 * q, **H)
            k.cp_async_commit()
    for j in range(stages):
        issue(j, None)
    with k.loop(0, steps) as j:
        if mode == "bulk":
            k.mbarrier_wait(k.add(mbar, k.shl(k.rem(j, stages), 3)), k.and_(k.div(j, stages), 1))
        else:
            k.cp_async_wait_group(stages - 1)
        if mode == "cta":
            k.bar_sync()
        k.bar_warp_sync()
        v = k.load("shared", "u32", k.add(k.add(ring, k.mul(k.rem(j, stages), chunk)), k.shl(lane, 2)))
        k.assign(acc, k.xor(acc, v))
        k.bar_warp_sync()
        if mode == "bulk":
            k.fence_proxy_async()
        if mode == "cta":
            k.bar_sync()
        nxt = k.add(j, stages)
        issue(nxt, k.setp("lt", nxt, steps))
    if mode != "bulk":
        k.cp_async_wait_all()
    k.store("global", "u32", k.add(k.global_ptr("out"), k.mul_wide(k.add(k.mul(k.ctaid(), 32 * warps), tid), 4)), acc)
    return k

ops = LayerOps(); stream = cuda.Stream(); _pdl.enable()
out = cuda.GpuBuffer(1 << 20, np.uint32)
cfgs = [c.split(":") for c in os.environ["RCFGS"].split(",")]
total = float(os.environ.get("MB", "33.03")) * 1e6
cache = {}
for mode, G, W, S, C in cfgs:
    G, W, S, C = int(G), int(W), int(S), int(C)
    n = int(total // (G * W * C))
    rb = 0
    if mode in ("gemv", "tiled", "cta"):  # C = 4608: 32 rows x 144 B; rows of rb bytes, G = 4096 / 32
        P = C // 32
        rb = int(total // (G * 32)) // (P * W) * (P * W)
        n = rb // (P * W)
    nbytes = G * W * n * C
    kern = ops.kernel("ringread_scratch", mode=mode, warps=W, stages=S, chunk=C, steps=n, rb=rb)
    key = nbytes
    if key not in cache:
        for bs in cache.values():
            for b in bs: b.free()
        cache.clear()
        cache[key] = [cuda.GpuBuffer(nbytes, np.uint8) for _ in range(n_copies(nbytes))]
    bufs = cache[key]
    fns = [(lambda b=bufs[i % len(bufs)]: ops._launch(kern, G, {"w": b.ptr, "out": out.ptr}, stream)) for i in range(max(len(bufs), 20))]
    try:
        us, _ = time_launches(fns, stream, True)
        us2, _ = time_launches(fns, stream, True)
    except Exception as e:
        print(mode, G, W, S, C, "ERROR", e, flush=True); break
    print(f"{mode:4s} {G:4d} CTAs x {W:2d} warps, {S} stages of {C:5d} B ({n} steps, {nbytes/1e6:.1f} MB): {us:.2f} / {us2:.2f} us  {nbytes/us/1e6/4.19*100:.0f}%", flush=True)
