"""Mixture-of-experts routing and combination on the device, so a decode step's graph stays static: the chosen
experts' ids live in device memory, where the expert kernels read them.

* ``moe_route``: per row of router logits ``[rows, experts]`` (f32), the ``used`` experts of largest logit (the
  lower expert first among equal ones, a NaN counting as the largest, as :mod:`argmax`'s packing orders them)
  and their softmax probabilities over all experts, renormalised to sum to 1 with ``norm``: ``ids [rows, used]``
  (u32, largest first) and ``weights [rows, used]`` (f32). One warp a row: a lane holds the logits ``lane,
  lane + 32, ...``; the softmax's maximum and sum are warp reductions, each pick a warp max of packed (logit,
  index) keys over the logits not picked yet. Launch: grid ceil(rows / meta["rows_per_cta"]), block
  meta["block"].
* ``moe_combine``: ``x[r, :] += sum_s weights[r, s] * y[r, s, :]`` for the experts' outputs ``y [rows, used,
  hidden]`` (f32, in slot order), one thread an element. Launch: grid (ceil(hidden / meta["block"]), rows),
  block meta["block"].
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.sampling.argmax import _warp_max_u64, pack

MAX_EXPERTS = 512
MAX_USED = 32
WARPS = 4


@kernel("moe_route", grid=[{"experts": 128, "used": 8}, {"experts": 8, "used": 2, "norm": False},
                           {"experts": 60, "used": 4}, {"experts": 256, "used": 1}])
def moe_route(m: Module, experts: int = 128, used: int = 8, norm: bool = True) -> KernelBuilder:
    """ids[r, :used], weights[r, :used] = the top ``used`` of softmax(logits[r, :experts]) (renormalised with
    ``norm``). Params: logits, ids, weights, rows. Launch: grid ceil(rows / meta["rows_per_cta"]), block
    meta["block"]."""
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be 1..{MAX_EXPERTS}, got {experts}")
    if not 1 <= used <= min(experts, MAX_USED):
        raise ValueError(f"used must be 1..{min(experts, MAX_USED)} (at most the experts), got {used}")
    name = f"moe_route_e{experts}_k{used}{'_norm' if norm else ''}"
    k = m.kernel(name, [("logits", "u64"), ("ids", "u64"), ("weights", "u64"), ("rows", "u32")],
                 max_threads=32 * WARPS)
    k.meta.update(block=32 * WARPS, rows_per_cta=WARPS)
    tid = k.tid()
    lane = k.and_(tid, 31)
    row = k.mad(k.ctaid(), WARPS, k.shr(tid, 5))
    done = k.new_label("done")
    k.bra(done, k.setp("ge", row, k.param("rows")))
    per = -(-experts // 32)
    k.grid_dependency_wait()  # (the router's logits come from the GEMV before)
    base = k.add(k.global_ptr("logits"), k.mul_wide(row, 4 * experts))
    idx = [k.add(lane, 32 * j) if j else lane for j in range(per)]
    live = [k.setp("lt", i, experts) if 32 * (j + 1) > experts else None for j, i in enumerate(idx)]
    vals = [k.load("global", "f32", k.add(base, k.mul_wide(i, 4)), pred=ok, other=float("-inf"))
            for i, ok in zip(idx, live)]
    top = vals[0]
    for v in vals[1:]:
        top = k.max(top, v, nan=True)
    top = k.warp_reduce(top, "max_nan")
    exps = [k.exp(k.sub(v, top)) for v in vals]
    total = exps[0]
    for e in exps[1:]:
        total = k.add(total, e)
    total = k.warp_reduce(total, "add")
    # candidates: packed (logit, index) keys; a picked one drops to 0 (below every key)
    keys = [k.var("u64", 0) for _ in range(per)]
    for key, v, i, ok in zip(keys, vals, idx, live):
        packed = pack(k, v, i)
        k.assign(key, packed if ok is None else k.selp(packed, 0, ok, "u64"))
    picks, probs = [], []
    for _ in range(used):
        best = keys[0]
        for key in keys[1:]:
            best = k.max(best, key)
        best = _warp_max_u64(k, best)
        win = k.sub(0xFFFFFFFF, k.cvt(best, "u32"), "u32")
        for key, i in zip(keys, idx):
            k.assign(key, k.selp(0, key, k.setp("eq", i, win), "u64"))
        # the winner's probability: its lane's exp over the total (every lane computes it from the shuffled value)
        owner = k.and_(win, 31)
        mine = exps[0]
        for j in range(1, per):
            mine = k.selp(exps[j], mine, k.setp("eq", k.shr(win, 5), j), "f32")
        picks.append(win)
        probs.append(k.shfl("idx", mine, owner))
    scale = k.rcp(total)
    if norm:
        chosen = probs[0]
        for p in probs[1:]:
            chosen = k.add(chosen, p)
        scale = k.rcp(chosen)
    with k.if_(k.setp("eq", lane, 0)):
        ids = k.add(k.global_ptr("ids"), k.mul_wide(row, 4 * used))
        ws = k.add(k.global_ptr("weights"), k.mul_wide(row, 4 * used))
        for s, (win, p) in enumerate(zip(picks, probs)):
            k.store("global", "u32", ids, win, 4 * s)
            k.store("global", "f32", ws, k.mul(p, scale), 4 * s)
    k.label(done)
    k.ret()
    return k


@kernel("moe_combine", grid=[{"used": 8}, {"used": 2, "block": 128}, {"used": 1}])
def moe_combine(m: Module, used: int = 8, block: int = 256) -> KernelBuilder:
    """x[r, c] += sum_s weights[r, s] * y[r, s, c]. Params: x, y, weights, hidden. Launch: grid
    (ceil(hidden / block), rows), block ``block``."""
    if not 1 <= used <= MAX_USED:
        raise ValueError(f"used must be 1..{MAX_USED}, got {used}")
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
    k = m.kernel(f"moe_combine_k{used}_b{block}", [("x", "u64"), ("y", "u64"), ("weights", "u64"), ("hidden", "u32")],
                 max_threads=block)
    k.meta.update(block=block)
    hidden = k.param("hidden")
    col = k.global_index_x()
    row = k.ctaid("y")
    with k.if_(k.setp("lt", col, hidden)):
        k.grid_dependency_wait()
        ws = k.add(k.global_ptr("weights"), k.mul_wide(row, 4 * used))
        y = k.add(k.global_ptr("y"), k.mul_wide(k.mad(k.mul(row, used), hidden, col), 4))
        stride = k.mul(hidden, 4)
        acc = k.mul(k.load("global", "f32", ws), k.load("global", "f32", y))
        for s in range(1, used):
            ys = k.add(y, k.mul_wide(stride, s))
            acc = k.fma(k.load("global", "f32", ws, 4 * s), k.load("global", "f32", ys), acc)
        xa = k.add(k.global_ptr("x"), k.mul_wide(k.mad(row, hidden, col), 4))
        k.store("global", "f32", xa, k.add(k.load("global", "f32", xa), acc))
    k.ret()
    return k
