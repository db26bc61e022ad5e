"""Activation rounding on a real model, on the CPU: the NumPy reference model with every linear layer's input
rounded to int8 as the batch GEMM's x8 format does (one scale per 256 values) or as llama.cpp's q8_1 does
(one per 32), against no rounding: the prefill logits' relative error (max |diff| / max |logit|) on a few
text prompts and how many greedy tokens stay equal to the unrounded run.

    python tools/activation_rounding.py MODEL.gguf [TOKENS]
"""
import sys

import numpy as np

from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel

MODE = {"mode": None}


def quant(x, block):
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    pad = -k % block
    xp = np.concatenate([x, np.zeros((*x.shape[:-1], pad), np.float32)], -1) if pad else x
    u = xp.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(u).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(u * inv)
    return (q * d).reshape(*xp.shape)[..., :k].astype(np.float32)


class QW(np.ndarray):
    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        args = [np.asarray(a) if isinstance(a, QW) else a for a in inputs]
        if ufunc is np.matmul and MODE["mode"] and not isinstance(inputs[0], QW):
            args[0] = quant(args[0], MODE["mode"])
        return getattr(ufunc, method)(*args, **kw)


def wrap(ref):
    for L in ref.layers:
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            if getattr(L, name, None) is not None:
                setattr(L, name, getattr(L, name).view(QW))
    ref.lm_head = ref.lm_head.view(QW)


path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 48
loaded = load_model(path)
from realizar.engine import load_tokenizer
tok = load_tokenizer(loaded)
texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
         "The three laws of thermodynamics state that"]
prompts = [list(tok.encode(t)) for t in texts]
base = {}
for mode in (None, 256, 32):
    MODE["mode"] = mode
    agree, errs = [], []
    for pi, prompt in enumerate(prompts):
        ref = ReferenceModel.from_loaded(loaded, max_len=256)
        wrap(ref)
        lg = ref.prefill(prompt)
        toks = [int(np.argmax(lg))]
        for _ in range(n - 1):
            toks.append(int(np.argmax(ref.decode(toks[-1]))))
        if mode is None:
            base[pi] = (lg, toks)
        else:
            b_lg, b_t = base[pi]
            errs.append(float(np.abs(lg - b_lg).max() / np.abs(b_lg).max()))
            same = next((i for i, (a, b) in enumerate(zip(toks, b_t)) if a != b), n)
            agree.append(same)
    if mode:
        print(f"per-{mode}: prefill logits rel err {', '.join(f'{e:.2e}' for e in errs)}; greedy tokens equal to the unrounded run for the first {agree} of {n}")
