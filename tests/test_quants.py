"""realizar.models.quants and ptx_gen.ggml: block layouts, sizes and dequantization."""

from __future__ import annotations

import gguf
import libgguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptx_gen import ggml
from realizar.errors import ShapeError, UnsupportedError
from realizar.models import quants
from realizar.models.quants import LAYOUTS, dequantize, layout, row_nbytes, tensor_nbytes
from realizar.models.tensor import QuantTensor
from tests.helpers import examples

ALL_TYPES = list(LAYOUTS)
BLOCK_TYPES = [t for t in ALL_TYPES if LAYOUTS[t].block_size > 1]
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]


def encode(x: np.ndarray, t: T) -> np.ndarray:
    """Raw bytes (uint8, rows) of float32 ``x`` in type ``t``; K-quants via libgguf (llama.cpp's)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if t == T.F32:
        return x.view(np.uint8)
    if t == T.F16:
        return x.astype(np.float16).view(np.uint8)
    if t in K_TYPES:
        return libgguf.quantize_rows(x, int(t))
    return gguf.quants.quantize(x, t)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# --------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_layout_matches_ggml_sizes(t):
    lay = LAYOUTS[t]
    assert (lay.block_size, lay.type_size) == gguf.GGML_QUANT_SIZES[t]
    assert lay.ggml_type == t and lay.name == t.name
    offset = 0
    for f in lay.fields:  # contiguous, in byte order, covering the block
        assert f.offset == offset
        offset += f.size
    assert offset == lay.type_size


def test_layout_offsets_documented_values():
    # The offsets GPU kernels rely on, spelled out.
    assert LAYOUTS[T.Q4_0].offset("qs") == 2
    assert (LAYOUTS[T.Q4_1].offset("m"), LAYOUTS[T.Q4_1].offset("qs")) == (2, 4)
    assert (LAYOUTS[T.Q5_0].offset("qh"), LAYOUTS[T.Q5_0].offset("qs")) == (2, 6)
    assert (LAYOUTS[T.Q5_1].offset("qh"), LAYOUTS[T.Q5_1].offset("qs")) == (4, 8)
    assert LAYOUTS[T.Q8_0].offset("qs") == 2
    k4 = LAYOUTS[T.Q4_K]
    assert (k4.offset("d"), k4.offset("dmin"), k4.offset("scales"), k4.offset("qs")) == (0, 2, 4, 16)
    k5 = LAYOUTS[T.Q5_K]
    assert (k5.offset("scales"), k5.offset("qh"), k5.offset("qs")) == (4, 16, 48)
    k6 = LAYOUTS[T.Q6_K]
    assert (k6.offset("ql"), k6.offset("qh"), k6.offset("scales"), k6.offset("d")) == (0, 128, 192, 208)
    assert LAYOUTS[T.Q4_1].bits_per_weight == 5.0
    with pytest.raises(KeyError):
        LAYOUTS[T.Q4_0].offset("m")


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_row_nbytes(t):
    lay = LAYOUTS[t]
    for blocks in (1, 2, 7):
        n = blocks * lay.block_size
        assert row_nbytes(t, n) == blocks * lay.type_size == libgguf.row_size(int(t), n)
    assert row_nbytes(t, 0) == 0
    if lay.block_size > 1:
        with pytest.raises(ShapeError, match=f"{t.name}.*not a multiple of the block size {lay.block_size}"):
            row_nbytes(t, lay.block_size + 1)
    assert tensor_nbytes(t, (3, 5, lay.block_size)) == 15 * lay.type_size


@pytest.mark.parametrize("t", [T.Q2_K, T.Q3_K, T.IQ4_NL, T.Q8_1, T.I8, T.F64, 99, 12345])
def test_unsupported_types(t):
    with pytest.raises(UnsupportedError, match="unsupported tensor type") as e:
        row_nbytes(t, 256)
    name = T(t).name if t in T._value2member_map_ else str(t)
    assert name in str(e.value)
    with pytest.raises(UnsupportedError):
        dequantize(np.zeros(1024, np.uint8), t, (256,))
    with pytest.raises(UnsupportedError):
        layout(t)


# --------------------------------------------------------------------------- dequantization


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 256), (5, 512), (2, 3, 256), (768,)])
def test_dequantize_matches_gguf_on_encoded_data(t, shape):
    rng = np.random.default_rng(hash((int(t), shape)) & 0xFFFF)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32)
    raw = encode(x, t)
    ours = dequantize(raw, t, shape)
    ref = gguf.quants.dequantize(raw, t)
    assert ours.dtype == np.float32 and ours.shape == shape
    assert same_bits(ours, ref.reshape(shape))
    # and it is a plausible reconstruction of x (guards against both being wrong the same way)
    err = np.abs(ours - x).max() / np.abs(x).max()
    assert err < {T.Q4_0: 0.15, T.Q4_1: 0.1, T.Q4_K: 0.1, T.Q5_0: 0.07, T.Q5_1: 0.05}.get(t, 0.03)


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_random_bytes_bitwise(t):
    """Arbitrary bytes (NaN/inf scales included) decode exactly as gguf.quants does."""
    lay = LAYOUTS[t]
    rng = np.random.default_rng(int(t))
    raw = rng.integers(0, 256, size=(4, 8 * lay.type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = gguf.quants.dequantize(raw, t)
        ours = dequantize(raw, t, (4, 8 * lay.block_size))
    assert same_bits(ours, ref)


def _block_strategy(t: T):
    """Blocks of type t: random bytes with every f16 field set to a finite f16 value."""
    lay = LAYOUTS[t]
    f16_fields = [f for f in lay.fields if f.dtype == "f16"]
    finite_f16 = st.floats(width=16, allow_nan=False, allow_infinity=False)

    @st.composite
    def blocks(draw):
        n = draw(st.integers(1, 3))
        raw = bytearray(draw(st.binary(min_size=n * lay.type_size, max_size=n * lay.type_size)))
        for b in range(n):
            for f in f16_fields:
                v = np.float16(draw(finite_f16)).tobytes()
                start = b * lay.type_size + f.offset
                raw[start : start + 2] = v
        return n, np.frombuffer(bytes(raw), dtype=np.uint8)

    return blocks()


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_dequantize_hypothesis_blocks(t, data):
    n, raw = data.draw(_block_strategy(t))
    lay = LAYOUTS[t]
    with np.errstate(over="ignore", invalid="ignore"):
        ours = dequantize(raw, t, (n * lay.block_size,))
        ref = gguf.quants.dequantize(raw.reshape(1, -1), t).reshape(-1)
    assert same_bits(ours, ref)


@settings(max_examples=examples(50), deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_float_types_hypothesis(values):
    x = np.array(values, dtype=np.float32)
    assert same_bits(dequantize(x.view(np.uint8), T.F32, x.shape), x)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    assert same_bits(dequantize(h.view(np.uint8), T.F16, x.shape), h.astype(np.float32))
    b = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert same_bits(dequantize(b.view(np.uint8), T.BF16, x.shape), gguf.quants.dequantize(b.view(np.uint8), T.BF16))


def test_bf16_known_values():
    x = np.array([1.0, -2.5, 0.0, -0.0, np.inf, 3.140625], dtype=np.float32)
    b = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert same_bits(dequantize(b, T.BF16, x.shape), x)


def test_q4_0_hand_made_block():
    # d = 0.5; codes 0..15 then 15..0; y = d * (q - 8)
    codes = np.r_[np.arange(16), np.arange(15, -1, -1)].astype(np.uint8)
    qs = codes[:16] | (codes[16:] << 4)
    raw = np.concatenate([np.array([0.5], np.float16).view(np.uint8), qs])
    assert np.array_equal(dequantize(raw, T.Q4_0, (32,)), 0.5 * (codes.astype(np.float32) - 8))


def test_q5_0_hand_made_block():
    codes = (np.arange(32) * 7 % 32).astype(np.uint8)
    qs = (codes[:16] & 15) | ((codes[16:] & 15) << 4)
    qh = np.uint32(sum(int(c >> 4) << i for i, c in enumerate(codes)))
    raw = np.concatenate(
        [np.array([0.25], np.float16).view(np.uint8), np.array([qh], "<u4").view(np.uint8), qs]
    )
    assert np.array_equal(dequantize(raw, T.Q5_0, (32,)), 0.25 * (codes.astype(np.float32) - 16))


def test_q6_k_hand_made_block():
    """Build a Q6_K block from the documented layout and check every value."""
    rng = np.random.default_rng(7)
    q = rng.integers(0, 64, 256)
    scales = rng.integers(-128, 128, 16).astype(np.int8)
    d = np.float16(0.125)
    ql = np.zeros(128, np.uint8)
    qh = np.zeros(64, np.uint8)
    for h in range(2):
        for l in range(32):
            v = [q[128 * h + l + 32 * k] for k in range(4)]
            ql[64 * h + l] = (v[0] & 15) | ((v[2] & 15) << 4)
            ql[64 * h + l + 32] = (v[1] & 15) | ((v[3] & 15) << 4)
            qh[32 * h + l] = (v[0] >> 4) | ((v[1] >> 4) << 2) | ((v[2] >> 4) << 4) | ((v[3] >> 4) << 6)
    raw = np.concatenate([ql, qh, scales.view(np.uint8), np.array([d]).view(np.uint8)])
    want = np.float32(d) * scales.astype(np.float32)[np.arange(256) // 16] * (q - 32).astype(np.float32)
    assert np.array_equal(dequantize(raw, T.Q6_K, (256,)), want)


def test_q4_k_hand_made_block():
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, 256)
    sc = rng.integers(0, 64, 8)
    mn = rng.integers(0, 64, 8)
    scales = np.zeros(12, np.uint8)
    for j in range(8):
        if j < 4:
            scales[j] |= sc[j]
            scales[j + 4] |= mn[j]
        else:
            scales[j + 4] = (sc[j] & 15) | ((mn[j] & 15) << 4)
            scales[j - 4] |= (sc[j] >> 4) << 6
            scales[j] |= (mn[j] >> 4) << 6
    qs = np.zeros(128, np.uint8)
    for c in range(4):
        qs[32 * c : 32 * c + 32] = q[64 * c : 64 * c + 32] | (q[64 * c + 32 : 64 * c + 64] << 4)
    d, dmin = np.float16(0.5), np.float16(0.25)
    raw = np.concatenate([np.array([d, dmin]).view(np.uint8), scales, qs])
    j = np.arange(256) // 32
    want = (np.float32(d) * sc[j].astype(np.float32)) * q.astype(np.float32) - np.float32(dmin) * mn[j].astype(np.float32)
    assert np.array_equal(dequantize(raw, T.Q4_K, (256,)), want.astype(np.float32))


def test_dequantize_accepts_typed_and_readonly_inputs(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(dequantize(x, T.F32, x.shape), x)
    assert np.array_equal(dequantize(x.astype(np.float16), T.F16, x.shape), x.astype(np.float16).astype(np.float32))
    raw = gguf.quants.quantize(x, T.Q8_0)
    path = tmp_path / "raw.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = dequantize(mm, T.Q8_0, x.shape)
    assert same_bits(out, gguf.quants.dequantize(raw, T.Q8_0))
    out[0, 0] = 1.0  # the result is a fresh writable array
    # A QuantTensor dequantizes itself the same way
    qt = QuantTensor("w", int(T.Q8_0), x.shape, mm)
    assert same_bits(qt.dequantize(), gguf.quants.dequantize(raw, T.Q8_0))
    assert qt.nbytes == raw.nbytes


def test_dequantize_wrong_size():
    with pytest.raises(ShapeError, match="needs 36 bytes, got 34"):
        dequantize(np.zeros(34, np.uint8), T.Q4_0, (64,))
    with pytest.raises(ShapeError, match="not a multiple of the block size"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (33,))


@pytest.mark.parametrize("t", [T.Q4_1, T.Q6_K, T.F32], ids=lambda t: t.name)
def test_dequantize_many_rows_row_by_row(t):
    """A tensor of many rows (gguf works through groups of them) decodes as its rows one by one."""
    x = np.random.default_rng(1).standard_normal((37, 512)).astype(np.float32)
    raw = encode(x, t).reshape(37, -1)
    whole = dequantize(raw, t, x.shape)
    assert all(same_bits(whole[i], dequantize(raw[i], t, (512,))) for i in range(37))
    if t == T.F32:
        assert not np.shares_memory(whole, raw)


def test_ggml_tables_need_no_realizar():
    """ptx_gen.ggml: the same tables, type ids equal to gguf's, plain ValueErrors."""
    assert quants.LAYOUTS is ggml.LAYOUTS
    for t in ggml.GGMLType:
        assert int(t) == int(T[t.name])
        assert ggml.layout(t.name) is ggml.layout(int(t)) is LAYOUTS[T[t.name]]
    with pytest.raises(ValueError, match="unsupported tensor type"):
        ggml.layout(int(T.Q2_K))
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        ggml.row_nbytes("Q4_K", 100)
    assert ggml.row_nbytes("Q8_0", 64) == 68
