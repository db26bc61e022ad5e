"""One launch of gemm_ws at an 8B shape for Nsight Compute (it times nothing itself):

    ncu --kernel-name regex:gemm_ws --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SourceCounters python tools/ncu_gemm_ws.py --shape gate/up --m 256 [--no-xtma]

Three launches of the policy's launch shape (``--no-xtma``: with the tokens' X by 16-byte copies instead of a
tensor map) over random Q4_K
weights in the layout the model stores them; ncu profiles the third.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm_x8 import SHAPES  # noqa: E402

from realizar import cuda  # noqa: E402
from realizar.gpu.gemm_wg import split_room, ws_config  # noqa: E402
from realizar.gpu.ops import LayerOps  # noqa: E402
from realizar.gpu.weights import GpuWeight  # noqa: E402
from realizar.models.random import random_weight  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gate/up", help="qkv, o, gate/up or down (8B)")
    ap.add_argument("--m", type=int, default=256, help="tokens")
    ap.add_argument("--xtma", action=argparse.BooleanOptionalAction, help="X by a tensor map (default: the policy's)")
    a = ap.parse_args()
    (n, k, glu), = [(n, k, glu) for model, label, n, k, glu in SHAPES if model == "8b" and label == a.shape]
    dev = cuda.current_device()
    ops, stream = LayerOps(dev), cuda.Stream(dev)
    rng = np.random.default_rng(0)
    cols = n // 2 if glu else n
    layout = ops.weight_layout(cols, k, "Q4_K", glu=glu)
    w = GpuWeight(data=random_weight(rng, "Q4_K", n, k), ggml_type="Q4_K", shape=(n, k), layout=layout, device=dev)
    x = ops.to_device((rng.standard_normal((a.m, k)) / 64).astype(np.float16))
    y = ops.buffer(a.m * cols, np.float16 if glu else np.float32)
    cfg = ws_config("Q4_K", k, layout, cols, a.m, ops.sm_count, dev.max_shared_per_block_optin, glu=glu)
    if a.xtma is not None:
        cfg = dataclasses.replace(cfg, xtma=a.xtma)
    room = split_room(cfg, cols, a.m, glu)  # (a launch that splits K: its partial sums and counters)
    split = ops.split_space(*room) if room[0] else None
    for _ in range(3):
        ops.gemm_ws(x, w, y, a.m, glu=glu, out_f16=glu, config=cfg, split=split, stream=stream)
    stream.synchronize()
    print(f"8b {a.shape} m={a.m} {layout} {cfg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
