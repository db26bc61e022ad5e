"""The launch shapes ptxas and the PTX hashes check for ``gemm_ws`` (:mod:`ptx_gen.kernels.gemm.gemm_ws`): every type in
the model's layouts, and each launch-shape kind the policy picks or a sweep tries."""

from __future__ import annotations


def grid() -> list[dict]:
    g = []
    for wt in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q4_1", "Q5_0", "Q5_1"):
        g.append({"wtype": wt, "in_dim": 4096, "layout": "tiles", "mt": 128, "residual": True})
        g.append({"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "mt": 128, "rgroups": 2, "glu": True,
                  "out_f16": True})
        g.append({"wtype": wt, "in_dim": 14336, "layout": "tiles", "mt": 64, "bias": True})
    for wt in ("Q4_K", "Q6_K", "Q8_0", "Q5_K"):
        g.append({"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "mt": 256, "rgroups": 2, "stages": 3, "glu": True,
                  "out_f16": True})
    g.append({"wtype": "Q4_K", "in_dim": 14336, "layout": "tiles", "mt": 256, "rgroups": 2, "stages": 3, "residual": True})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "tiles", "mt": 128, "stages": 3})
    for wt in ("Q4_K", "Q6_K"):  # X by a tensor map
        g.append({"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "mt": 256, "rgroups": 2, "stages": 3, "glu": True,
                  "out_f16": True, "xtma": True})
        g.append({"wtype": wt, "in_dim": 14336, "layout": "tiles", "mt": 128, "residual": True, "xtma": True})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "glu-tiles", "mt": 256, "rgroups": 2, "stages": 3, "glu": True,
              "out_f16": True, "xtma": True, "f16dec": True})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "rows", "mt": 128, "residual": True, "f16dec": True})
    g.append({"wtype": "Q6_K", "in_dim": 4096, "layout": "tiles", "mt": 128, "wstages": 3})
    for wt in ("Q4_K", "Q6_K"):  # K split over two CTAs (o and down at batched-decode and prefill token counts)
        g.append({"wtype": wt, "in_dim": 14336, "layout": "tiles", "mt": 256, "rgroups": 2, "stages": 3, "residual": True,
                  "xtma": True, "f16dec": wt == "Q4_K", "kparts": 2})
        g.append({"wtype": wt, "in_dim": 4096, "layout": "rows", "mt": 128, "rgroups": 2, "residual": True, "xtma": True,
                  "f16dec": wt == "Q4_K", "kparts": 2})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "rows", "mt": 64, "stages": 2})
    g.append({"wtype": "F16", "in_dim": 2048, "layout": "rows", "mt": 64})
    # rings deeper than a chunk (o and down at 128 tokens one CTA an SM, gate/up at 128 tokens)
    g.append({"wtype": "Q4_K", "in_dim": 14336, "layout": "tiles", "mt": 128, "stages": 7, "residual": True,
              "xtma": True, "f16dec": True, "kparts": 2})
    for st in (6, 8):
        g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "rows", "mt": 64, "stages": st, "residual": True,
                  "xtma": True, "f16dec": True})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "glu-tiles", "mt": 128, "rgroups": 2, "stages": 5, "glu": True,
              "out_f16": True, "xtma": True, "f16dec": True})
    # K split over four CTAs (o and down at 128 and 256 tokens on 128-row tiles: 128 CTAs)
    for mt, st in ((128, 4), (256, 3)):
        g.append({"wtype": "Q4_K", "in_dim": 14336, "layout": "tiles", "mt": mt, "rgroups": 2, "stages": st,
                  "residual": True, "xtma": True, "f16dec": True, "kparts": 4})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "rows", "mt": 128, "rgroups": 2, "residual": True, "xtma": True,
              "f16dec": True, "kparts": 4})
    # producer warpgroups sharing a strip's stages (o, down and qkv on 64- to 256-token tiles, gate/up at 128 tokens)
    for mt, rg, ps, st, kp, lay, k_ in ((128, 1, 2, 4, 2, "tiles", 14336), (128, 1, 4, 4, 2, "tiles", 14336),
                                        (64, 1, 4, 6, 1, "rows", 4096), (256, 1, 2, 4, 1, "rows", 4096),
                                        (64, 2, 2, 3, 4, "tiles", 14336)):
        g.append({"wtype": "Q4_K", "in_dim": k_, "layout": lay, "mt": mt, "rgroups": rg, "stages": st, "residual": True,
                  "xtma": True, "f16dec": True, "kparts": kp, "psplit": ps})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "glu-tiles", "mt": 64, "rgroups": 2, "stages": 4, "glu": True,
              "out_f16": True, "xtma": True, "f16dec": True, "psplit": 2})
    # producers fencing and announcing two or four stages at once (o, down, gate/up, qkv)
    for mt, rg, st, kp, pf, lay, k_ in ((128, 2, 4, 2, 2, "tiles", 14336), (128, 2, 5, 4, 4, "tiles", 14336),
                                        (128, 1, 5, 2, 4, "rows", 4096), (256, 1, 4, 1, 2, "rows", 4096)):
        g.append({"wtype": "Q4_K", "in_dim": k_, "layout": lay, "mt": mt, "rgroups": rg, "stages": st, "residual": True,
                  "xtma": True, "f16dec": True, "kparts": kp, "pfence": pf})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "glu-tiles", "mt": 256, "rgroups": 2, "stages": 3, "glu": True,
              "out_f16": True, "xtma": True, "f16dec": True, "pfence": 2})
    # X multicast to a cluster pair (every launch shape of the 8B policy at 96-512 tokens)
    for mt, rg, st, kp, lay, k_ in ((128, 1, 4, 1, "tiles", 4096), (64, 1, 4, 2, "rows", 4096),
                                    (128, 2, 4, 4, "tiles", 14336), (128, 2, 4, 2, "tiles", 14336),
                                    (256, 1, 4, 1, "rows", 4096)):
        g.append({"wtype": "Q4_K", "in_dim": k_, "layout": lay, "mt": mt, "rgroups": rg, "stages": st, "residual": True,
                  "xtma": True, "f16dec": True, "kparts": kp, "pfence": 2, "xcast": 2})
    for mt, st in ((128, 4), (256, 3)):
        g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "glu-tiles", "mt": mt, "rgroups": 2, "stages": st,
                  "glu": True, "out_f16": True, "xtma": True, "f16dec": True, "pfence": 2, "xcast": 2})
    # Stream-K (gate/up at 256 tokens, 224 tiles over 132 CTAs; o at 128 tokens)
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "glu-tiles", "mt": 256, "rgroups": 2, "stages": 3, "glu": True,
              "out_f16": True, "xtma": True, "f16dec": True, "pfence": 2, "streamk": True})
    g.append({"wtype": "Q6_K", "in_dim": 4096, "layout": "rows", "mt": 128, "residual": True, "xtma": True,
              "pfence": 2, "streamk": True})
    # a diagnostic launch (the weights neither copied nor decoded: what the X copies, MMAs and barriers cost alone)
    g.append({"wtype": "Q4_K", "in_dim": 14336, "layout": "tiles", "mt": 128, "rgroups": 2, "residual": True,
              "xtma": True, "f16dec": True, "kparts": 2, "pfence": 2, "ablate": "decode+wload"})
    return g
