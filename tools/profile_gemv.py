"""A few GEMV launches to profile under Nsight Compute (one launch per type at 4096x14336).

    ncu --clock-control none --set full -k regex:gemv python tools/profile_gemv.py --types Q4_K,Q8_0
    ... python tools/profile_gemv.py --types Q5_K --out-dim 14336 --in-dim 4096 --configs 1,4,2,2 4,2,2,2,solo

``--configs``: tensor-core launch shapes to run besides the dispatcher's (mtiles,kparts,stages,tiles and
the flags bulk, solo, late), each on the weight as LayerOps stores it.
"""

from __future__ import annotations

import argparse

import numpy as np

from realizar import cuda
from realizar.gpu.ops import GpuWeight, LayerOps, MmaConfig
from realizar.models.random import random_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q8_0,Q6_K")
    ap.add_argument("--out-dim", type=int, default=4096)
    ap.add_argument("--in-dim", type=int, default=14336)
    ap.add_argument("--configs", nargs="*", default=[], help="extra launch shapes, e.g. 1,4,2,2,bulk")
    a = ap.parse_args()
    extra = []
    for text in a.configs:
        parts = text.split(",")
        flags = set(parts[4:])
        if not flags <= {"bulk", "solo", "late"}:
            raise SystemExit(f"--configs: flags are bulk, solo, late; got {text!r}")
        extra.append(MmaConfig(*(int(v) for v in parts[:4]), bulk="bulk" in flags, solo="solo" in flags,
                               late="late" in flags))
    ops = LayerOps()
    rng = np.random.default_rng(0)
    x = cuda.GpuBuffer.from_numpy(rng.standard_normal(a.in_dim).astype(np.float32))
    y = cuda.GpuBuffer(a.out_dim)
    for wtype in a.types.split(","):
        raw = random_weight(rng, wtype, a.out_dim, a.in_dim)
        layout = ops.weight_layout(a.out_dim, a.in_dim, wtype)  # (as LayerOps.upload stores it)
        w = GpuWeight(data=raw, ggml_type=wtype, shape=(a.out_dim, a.in_dim), layout=layout)
        for cfg in [None] + extra:
            ops.gemv(w, x, y, config=cfg)
            cuda.current_device().synchronize()
            print("ran", wtype, layout, cfg or ops.mma_config(a.out_dim, a.in_dim, wtype, layout=layout))


if __name__ == "__main__":
    main()
