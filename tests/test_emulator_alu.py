"""The emulator's register instructions, one form at a time, against NumPy on drawn (never all-zero) data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tests.emulator_ptx import one_op, run_words
from tests.helpers import examples

N = 32
i32 = arrays(np.int32, N, elements=st.integers(-2**31, 2**31 - 1)).filter(lambda x: x.any())
u32 = arrays(np.uint32, N, elements=st.integers(0, 2**32 - 1)).filter(lambda x: x.any())
f32 = arrays(np.float32, N, elements=st.floats(-1e4, 1e4, width=32)).filter(lambda x: x.any())
SETTINGS = settings(max_examples=examples(15), deadline=None)

INT_OPS = {
    "add.s32": lambda a, b: a + b, "sub.s32": lambda a, b: a - b, "mul.lo.s32": lambda a, b: a * b,
    "min.s32": np.minimum, "max.s32": np.maximum, "min.u32": None, "and.b32": np.bitwise_and,
    "or.b32": np.bitwise_or, "xor.b32": np.bitwise_xor,
}


@pytest.mark.parametrize("op", [o for o, f in INT_OPS.items() if f is not None])
@SETTINGS
@given(a=i32, b=i32)
def test_integer_binary(op, a, b):
    with np.errstate(over="ignore"):
        want = INT_OPS[op](a, b).astype(np.int32)
    assert np.array_equal(run_words(one_op(f"    {op} %r3, %r1, %r2;"), a, b), want)


@SETTINGS
@given(a=u32, b=u32)
def test_unsigned_min_mul_hi_and_div_rem(a, b):
    assert np.array_equal(run_words(one_op("    min.u32 %r3, %r1, %r2;"), a, b), np.minimum(a, b))
    hi = ((a.astype(np.uint64) * b.astype(np.uint64)) >> np.uint64(32)).astype(np.uint32)
    assert np.array_equal(run_words(one_op("    mul.hi.u32 %r3, %r1, %r2;"), a, b), hi)
    b1 = b | 1
    assert np.array_equal(run_words(one_op("    div.u32 %r3, %r1, %r2;"), a, b1), a // b1)
    assert np.array_equal(run_words(one_op("    rem.u32 %r3, %r1, %r2;"), a, b1), a % b1)


@SETTINGS
@given(a=i32, b=i32)
def test_signed_mul_hi_div_rem_truncate_toward_zero(a, b):
    hi = ((a.astype(np.int64) * b.astype(np.int64)) >> 32).astype(np.int32)
    assert np.array_equal(run_words(one_op("    mul.hi.s32 %r3, %r1, %r2;"), a, b), hi)
    b1 = np.where(b == 0, 7, b).astype(np.int32)
    q = np.trunc(a.astype(np.float64) / b1).astype(np.int64).astype(np.int32)
    assert np.array_equal(run_words(one_op("    div.s32 %r3, %r1, %r2;"), a, b1), q)
    assert np.array_equal(run_words(one_op("    rem.s32 %r3, %r1, %r2;"), a, b1), np.fmod(a, b1))


@SETTINGS
@given(a=i32, b=u32)
def test_shifts_past_the_width(a, b):
    n = (b % 40).astype(np.uint32)  # counts of 32..39 shift everything out
    au = a.view(np.uint32)
    shl = np.where(n >= 32, 0, au.astype(np.uint64) << np.minimum(n, 31).astype(np.uint64)).astype(np.uint32)
    assert np.array_equal(run_words(one_op("    shl.b32 %r3, %r1, %r2;"), au, n), shl)
    shr_u = np.where(n >= 32, 0, au >> np.minimum(n, 31)).astype(np.uint32)
    assert np.array_equal(run_words(one_op("    shr.u32 %r3, %r1, %r2;"), au, n), shr_u)
    assert np.array_equal(run_words(one_op("    shr.s32 %r3, %r1, %r2;"), a, n.view(np.int32)),
                          a >> np.minimum(n, 31).astype(np.int32))


@SETTINGS
@given(a=u32, b=u32)
def test_bit_field_extract_permute_and_funnel_shift(a, b):
    pos, ln = (b & 31).astype(np.uint32), ((b >> 8) % 33).astype(np.uint32)
    code = "    and.b32 %r4, %r2, 31;\n    shr.u32 %r5, %r2, 8;\n    rem.u32 %r5, %r5, 33;\n"
    mask = np.where(ln >= 32, 0xFFFFFFFF, (np.uint64(1) << ln.astype(np.uint64)) - np.uint64(1)).astype(np.uint64)
    field = ((a.astype(np.uint64) >> pos.astype(np.uint64)) & mask).astype(np.uint32)
    field = np.where(ln == 0, 0, field)
    assert np.array_equal(run_words(one_op(code + "    bfe.u32 %r3, %r1, %r4, %r5;"), a, b), field)
    # prmt: byte i of the result is byte sel_i of {b, a}; selectors 0..7 drawn from b
    sel = (b & 0x7777).astype(np.uint32)
    both = a.astype(np.uint64) | (sel.astype(np.uint64) << np.uint64(32))
    want = np.zeros(N, np.uint64)
    for i in range(4):
        s = (sel.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(7)
        want |= ((both >> (s * np.uint64(8))) & np.uint64(0xFF)) << np.uint64(8 * i)
    got = run_words(one_op("    and.b32 %r4, %r2, 0x7777;\n    prmt.b32 %r3, %r1, %r4, %r4;"), a, b)
    assert np.array_equal(got, want.astype(np.uint32))
    n = (b & 31).astype(np.uint64)
    funnel = (((a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))) << n) >> np.uint64(32)) & np.uint64(0xFFFFFFFF)
    got = run_words(one_op("    and.b32 %r4, %r2, 31;\n    shf.l.wrap.b32 %r3, %r1, %r2, %r4;"), a, b)
    assert np.array_equal(got, funnel.astype(np.uint32))


FLOAT_OPS = {
    "add.f32": lambda a, b: a + b, "sub.f32": lambda a, b: a - b, "mul.f32": lambda a, b: a * b,
    "div.rn.f32": lambda a, b: a / b, "min.f32": np.fmin, "max.f32": np.fmax,
}


@pytest.mark.parametrize("op", FLOAT_OPS)
@SETTINGS
@given(a=f32, b=f32)
def test_float_binary(op, a, b):
    b = np.where(b == 0, np.float32(0.5), b).astype(np.float32)
    got = run_words(one_op(f"    {op} %r3, %r1, %r2;"), a, b)
    assert np.array_equal(got, FLOAT_OPS[op](a, b).astype(np.float32))


@SETTINGS
@given(a=f32, b=f32)
def test_fma_rounds_once_and_integer_mad(a, b):
    want = (a.astype(np.float64) * b + a).astype(np.float32)
    assert np.array_equal(run_words(one_op("    fma.rn.f32 %r3, %r1, %r2, %r1;"), a, b), want)
    ai, bi = a.astype(np.int32), b.astype(np.int32)
    with np.errstate(over="ignore"):
        assert np.array_equal(run_words(one_op("    mad.lo.s32 %r3, %r1, %r2, %r1;"), ai, bi), ai * bi + ai)


@SETTINGS
@given(a=f32)
def test_unary_float(a):
    x = np.abs(a) + np.float32(0.25)
    assert np.array_equal(run_words(one_op("    neg.f32 %r3, %r1;"), a, a), -a)
    assert np.array_equal(run_words(one_op("    abs.f32 %r3, %r1;"), a, a), np.abs(a))
    assert np.array_equal(run_words(one_op("    sqrt.rn.f32 %r3, %r1;"), x, x), np.sqrt(x))
    assert np.allclose(run_words(one_op("    rsqrt.approx.f32 %r3, %r1;"), x, x), 1 / np.sqrt(x), rtol=1e-6)
    assert np.allclose(run_words(one_op("    rcp.rn.f32 %r3, %r1;"), x, x), 1 / x, rtol=1e-7)
    small = (a / np.float32(1e3)).astype(np.float32)
    assert np.allclose(run_words(one_op("    ex2.approx.f32 %r3, %r1;"), small, small), np.exp2(small), rtol=1e-6)
    assert np.allclose(run_words(one_op("    lg2.approx.f32 %r3, %r1;"), x, x), np.log2(x), rtol=1e-6, atol=1e-7)


@SETTINGS
@given(a=f32)
def test_conversions_round_as_asked(a):
    x = (a * np.float32(0.37)).astype(np.float32)
    for rnd, fn in (("rzi", np.trunc), ("rni", np.rint), ("rmi", np.floor), ("rpi", np.ceil)):
        got = run_words(one_op(f"    cvt.{rnd}.s32.f32 %r3, %r1;"), x, x).view(np.int32)
        assert np.array_equal(got, fn(x).astype(np.int32)), rnd
    i = x.astype(np.int32)
    assert np.array_equal(run_words(one_op("    cvt.rn.f32.s32 %r3, %r1;"), i, i).view(np.float32), i.astype(np.float32))
    half = run_words(one_op("    cvt.rn.f16.f32 %h1, %r1;\n    cvt.f32.f16 %r3, %h1;"), x, x)
    assert np.array_equal(half, x.astype(np.float16).astype(np.float32))


@SETTINGS
@given(a=f32, b=f32)
def test_setp_selp_and_guarded_execution(a, b):
    a = a.copy()
    a[::5] = np.nan  # ordered comparisons are false on NaN
    for cmp, fn in (("lt", np.less), ("ge", np.greater_equal), ("eq", np.equal), ("ne", np.not_equal)):
        code = f"    setp.{cmp}.f32 %p1, %r1, %r2;\n    selp.b32 %r3, 1, 0, %p1;"
        want = fn(a, b) & ~np.isnan(a) & ~np.isnan(b)
        assert np.array_equal(run_words(one_op(code), a, b).view(np.uint32), want.astype(np.uint32)), cmp
    code = "    mov.b32 %r3, %r2;\n    setp.gt.f32 %p1, %r1, %r2;\n    @%p1 mov.b32 %r3, %r1;"
    assert np.array_equal(run_words(one_op(code), a, b), np.where(a > b, a, b), equal_nan=True)
    code = "    mov.b32 %r3, %r2;\n    setp.gt.f32 %p1, %r1, %r2;\n    @!%p1 mov.b32 %r3, %r1;"
    assert np.array_equal(run_words(one_op(code), a, b), np.where(a > b, b, a), equal_nan=True)


@SETTINGS
@given(a=u32, b=u32)
def test_mov_packs_and_unpacks_halves(a, b):
    code = "    mov.b32 {%h1, %h2}, %r1;\n    mov.b32 %r3, {%h2, %h1};"
    assert np.array_equal(run_words(one_op(code), a, b), (a >> 16) | (a << 16))
