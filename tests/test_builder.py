"""CPU tests of the PTX builder: register freshness, determinism, every instruction form valid for ptxas."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.builder import Module, Var
from ptx_gen.ptxas import PtxasError, assemble
from ptx_gen.target import SUPPORTED_TARGETS, Target
from ptx_gen.types import format_immediate, ptx_type
from tests.helpers import examples


def _dest_registers(ptx: str) -> list[str]:
    """Registers written by instructions (first operand), excluding stores, branches and barriers."""
    dests = []
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith(("//", ".", "$", "{", "}", ")", "@")) or s.startswith(("st.", "bra", "bar", "ret", "red.", "membar")):
            continue
        m = re.match(r"[\w.]+\s+(\{[^}]*\}|%\w+)", s)
        if m:
            dests += re.findall(r"%\w+", m.group(1))
    return dests


def _kitchen_sink(target: str) -> str:
    """One kernel using every instruction family the builder offers."""
    m = Module(target, header="kernel: kitchen_sink")
    k = m.kernel("kitchen_sink", [("x", "u64"), ("y", "u64"), ("n", "u32"), ("alpha", "f32")], max_threads=256)
    x, y, n, alpha = k.global_ptr("x"), k.global_ptr("y"), k.param("n"), k.param("alpha")
    i = k.global_index_x()
    off = k.mul_wide(i, 16)
    inb = k.setp("lt", i, n)
    v4 = k.load("global", "f32", k.add(x, off), vec=4, nc=True, pred=inb, other=0.0)
    v2 = k.load("global", "f32", k.add(x, off), 8, vec=2)
    s = k.load("global", "f32", k.add(x, off), 4)
    a = k.fma(v4[0], alpha, v4[1])
    b = k.div(k.sub(a, v2[0]), k.add(v4[2], 1.0))
    c = k.div(b, 3.0, approx=True)
    e = k.add(k.ex2(c), k.lg2(k.abs(c)))
    f = k.add(k.rcp(e), k.rcp(e, approx=True))
    g = k.add(k.sqrt(k.abs(f)), k.sqrt(k.abs(f), approx=True))
    h = k.max(k.min(k.rsqrt(k.abs(g)), 1e3), k.neg(s))
    q = k.exp(h)
    # conversions
    half = k.cvt(q, "f16")
    bf = k.cvt(q, "bf16")
    back = k.add(k.cvt(half, "f32"), k.cvt(bf, "f32"))
    si = k.cvt(back, "s32")
    ui = k.cvt(k.abs(back), "u32")
    wide = k.cvt(ui, "u64")
    sf = k.cvt(si, "f32")
    packed = k.pack_b32(half, bf)
    lo, _hi = k.unpack_b32(packed)
    # integer ops
    t = k.tid()
    r = k.xor(k.or_(k.and_(t, 7), 8), 3)
    r2 = k.shr(k.shl(r, 2), 1)
    r3 = k.rem(k.div(k.mad(r2, 3, 5), 2), 7)
    r4 = k.mul_hi(r3, 0x9E3779B9)
    r5 = k.selp(r4, r3, k.setp("ge", r4, r3))
    r6 = k.mad_wide(r5, 4, wide)
    # warp collectives
    w = k.warp_reduce(sf, "max")
    w = k.add(w, k.shfl("down", w, 1))
    w = k.add(w, k.shfl("up", w, 1))
    w = k.add(w, k.shfl("idx", w, 0))
    iw = k.shfl("bfly", r5, 4)
    iw = k.add(k.redux(iw, "max"), k.redux(k.bitcast(r4, "s32"), "min"))
    iw = k.xor(iw, k.redux(r3, "xor"))
    # shared memory, static and dynamic, barriers, atomics
    sm = k.shared_array("tile", "f32", 256)
    dyn = k.dynamic_shared()
    slot = k.add(sm, k.shl(t, 2))
    k.store("shared", "f32", slot, w)
    k.store("shared", "f32", k.add(dyn, k.shl(t, 2)), w)
    stage = k.add(dyn, k.add(k.shl(t, 4), 1024))  # async copies, with and without L2 hints
    k.cp_async(stage, k.add(x, off), pred=inb, prefetch="128B", policy=k.create_policy("evict_first"))
    k.cp_async(stage, k.add(x, off), src_offset=16, prefetch="256B")
    k.cp_async(stage, k.add(x, off), policy=k.create_policy("evict_last", 0.5))
    k.cp_async_commit()
    k.cp_async_wait_all()
    k.bar_sync()
    back_s = k.load("shared", "f32", slot)
    k.atom("shared", "add", "f32", sm, back_s)
    k.atom("global", "cas", "b32", y, iw, compare=0)
    k.red("global", "add", "f32", y, 1.0, 4)
    k.fence("cta")
    # control flow: loop with a loop-carried Var, a conditional, predicated stores
    acc = k.var("f32", 0.0)
    with k.loop(0, n, 32) as j:
        k.assign(acc, k.add(acc, k.cvt(j, "f32")))
    with k.if_(k.setp("ne", r6, 0, "u64")):
        k.store("global", "f32", k.add(y, off), [acc, back_s, q, sf], pred=inb)
    k.store("global", "b16", y, lo, 2, pred=inb, negate=True)
    k.ret()
    return m.emit()


@pytest.mark.parametrize("target", SUPPORTED_TARGETS)
def test_every_instruction_form_assembles(target):
    reports = assemble(_kitchen_sink(target), target)
    assert reports[0].entry == "kitchen_sink"
    assert reports[0].registers > 0


def test_values_are_never_reassigned():
    ptx = _kitchen_sink("sm_90")
    dests = _dest_registers(ptx)
    loop_vars = set(re.findall(r"mov\.\w+ (%\w+), %f\d+;", ptx))  # Var updates
    counts = {}
    for d in dests:
        counts[d] = counts.get(d, 0) + 1
    reassigned = {r for r, c in counts.items() if c > 1}
    # Only explicit Vars (loop counters/accumulators) and predicated-load defaults may be written twice.
    allowed = loop_vars | set(re.findall(r"mov\.\w+ (%\w+), 0f00000000;", ptx)) | set(re.findall(r"mov\.u32 (%r\d+), 0;", ptx))
    assert reassigned <= allowed, reassigned - allowed


def test_old_and_new_max_live_in_different_registers():
    """The online-softmax pattern: m_new = max(m_old, x) must never overwrite m_old's register."""
    m = Module("sm_90")
    k = m.kernel("softmax_pattern", [("x", "u64")])
    m_run = k.var("f32", float("-inf"))
    x = k.load("global", "f32", k.global_ptr("x"))
    m_new = k.max(m_run, x)
    correction = k.ex2(k.sub(m_run, m_new))
    k.assign(m_run, m_new)
    k.store("global", "f32", k.global_ptr("x"), correction)
    k.ret()
    assert m_new.name != m_run.name and isinstance(m_run, Var) and not isinstance(m_new, Var)
    ptx = m.emit()
    sub_line = next(line for line in ptx.splitlines() if "sub.f32" in line)
    assert m_run.name in sub_line and m_new.name in sub_line
    assemble(ptx, "sm_90")


def test_immutable_values_refuse_assignment():
    k = Module("sm_90").kernel("k", [])
    v = k.add(k.tid(), 1)
    with pytest.raises(TypeError, match="immutable"):
        k.assign(v, 3)


@settings(max_examples=examples(25), deadline=None)
@given(vec=st.sampled_from([1, 2, 4]), block=st.sampled_from([32, 64, 256, 1024]), target=st.sampled_from(SUPPORTED_TARGETS))
def test_emission_is_deterministic(vec, block, target):
    from ptx_gen.catalog import _emit_cached, emit

    first = emit("vector_add", target=target, vec=vec).ptx
    _emit_cached.cache_clear()
    assert emit("vector_add", target=target, vec=vec).ptx == first
    assert emit("row_sum", target=target, block=block).ptx == emit("row_sum", target=target, block=block).ptx


def test_header_names_kernel_shape_and_target():
    from ptx_gen.catalog import emit

    ptx = emit("row_sum", target="sm_89", block=128).ptx
    head = ptx.splitlines()[:6]
    assert "// kernel: row_sum" in head and "// shape: block=128" in head
    assert ".version 8.0" in ptx and ".target sm_89" in ptx and ".address_size 64" in ptx


@pytest.mark.parametrize("value,t,expected", [
    (1.0, "f32", "0f3F800000"), (-2.5, "f32", "0fC0200000"), (float("-inf"), "f32", "0fFF800000"),
    (1.0, "f64", "0d3FF0000000000000"), (7, "u32", "7"), (-3, "s32", "-3"), (0xFFFFFFFF, "u32", "0xFFFFFFFF"),
])
def test_immediates_are_exact(value, t, expected):
    assert format_immediate(value, ptx_type(t)) == expected


def test_bad_inputs_raise_clear_errors():
    k = Module("sm_90").kernel("k", [("p", "u32")])
    with pytest.raises(ValueError, match="unknown PTX type"):
        k.reg("f33")
    with pytest.raises(ValueError, match="vector width"):
        k.load("global", "f32", k.mov(0, "u64"), vec=3)
    with pytest.raises(ValueError, match="needs `other`"):
        k.load("global", "f32", k.mov(0, "u64"), pred=k.setp("eq", k.tid(), 0))
    with pytest.raises(TypeError, match="64-bit"):
        k.global_ptr("p")
    with pytest.raises(KeyError, match="no parameter"):
        k.param("q")
    with pytest.raises(ValueError, match="does not fit"):
        format_immediate(1 << 40, ptx_type("u32"))
    with pytest.raises(ValueError, match="unsupported target"):
        Target("sm_70")
    with pytest.raises(ValueError, match="prefetch must be one of"):
        k.cp_async(k.mov(0, "u32"), k.mov(0, "u64"), prefetch="32B")
    with pytest.raises(TypeError, match="64-bit register from create_policy"):
        k.cp_async(k.mov(0, "u32"), k.mov(0, "u64"), policy=k.mov(0, "u32"))
    with pytest.raises(TypeError, match="64-bit register from create_policy"):
        k.cp_async_bulk(k.mov(0, "u32"), k.mov(0, "u64"), 16, k.mov(0, "u32"), policy=k.mov(0, "u32"))
    with pytest.raises(ValueError, match="evict must be one of"):
        k.create_policy("evict_soon")
    with pytest.raises(ValueError, match="fraction"):
        k.create_policy("evict_first", 0.0)


def test_ptxas_errors_carry_the_log():
    ptx = _kitchen_sink("sm_90").replace("fma.rn.f32", "fma.rx.f32", 1)
    with pytest.raises(PtxasError) as info:
        assemble(ptx, "sm_90")
    assert "error" in info.value.log.lower()


@pytest.mark.parametrize("cc,expected", [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90"), ((10, 0), "sm_90")])
def test_target_from_compute_capability(cc, expected):
    assert Target.from_compute_capability(*cc).sm == expected
    with pytest.raises(ValueError, match="sm_80 or newer"):
        Target.from_compute_capability(7, 5)


def test_sm90_kernels_open_with_programmatic_dependent_launch_controls():
    from ptx_gen.catalog import emit

    body90 = emit("row_sum", target="sm_90").ptx.split("{", 1)[1]
    assert body90.index("griddepcontrol.wait;") < body90.index("ld.param")
    assert "griddepcontrol.launch_dependents;" in body90
    assert "griddepcontrol" not in emit("row_sum", target="sm_80").ptx  # sm_80 has no such instruction


def test_programmatic_dependent_launch_scope_is_restored():
    import importlib

    launch_mod = importlib.import_module("realizar.cuda.launch")  # the module, not the function of that name

    assert not getattr(launch_mod._local, "pdl", False)
    with launch_mod.programmatic_dependent_launch():
        assert launch_mod._local.pdl is True
        with launch_mod.programmatic_dependent_launch(False):
            assert launch_mod._local.pdl is False
        assert launch_mod._local.pdl is True
    assert launch_mod._local.pdl is False


def test_parameters_first_used_inside_a_branch_are_loaded_at_entry():
    """A parameter first asked for inside one branch and reused in another must be defined on both."""
    m = Module("sm_90")
    k = m.kernel("branchy", [("x", "u64"), ("alpha", "f32")])
    p = k.setp("eq", k.tid(), 0)
    with k.if_(p):
        k.store("global", "f32", k.global_ptr("x"), k.param("alpha"))
    with k.if_(p, negate=True):
        k.store("global", "f32", k.global_ptr("x"), k.add(k.param("alpha"), 1.0), 4)
    k.ret()
    lines = [line.strip() for line in m.emit().splitlines()]
    first_branch = next(i for i, line in enumerate(lines) if line.startswith("@"))
    loads = [i for i, line in enumerate(lines) if line.startswith(("ld.param", "cvta.to.global"))]
    assert len(loads) == 3 and max(loads) < first_branch
    assemble(m.emit(), "sm_90")


@settings(max_examples=examples(25), deadline=None)
@given(op=st.sampled_from(["add", "min", "max", "and", "or", "xor"]), signed=st.booleans(), warps=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_redux_matches_numpy_on_the_emulator(op, signed, warps, seed):
    """``redux.sync`` (one whole-warp integer reduction) against numpy, every lane of every warp checked:
    values over the whole 32-bit range (sums wrap modulo 2**32 as the hardware's do)."""
    from ptx_gen.emulator import Memory, run as simt_run

    t = "s32" if signed else "u32"
    m = Module(Target("sm_80"))
    k = m.kernel("redux_probe", [("x", "u64"), ("y", "u64")])
    tid = k.tid()
    off = k.mul_wide(tid, 4)
    v = k.load("global", t, k.add(k.global_ptr("x"), off))
    k.store("global", t, k.add(k.global_ptr("y"), off), k.redux(v, op))
    k.ret()
    rng = np.random.default_rng(seed)
    n = 32 * warps
    dt = np.int32 if signed else np.uint32
    x = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, n, endpoint=True).astype(dt)
    mem = Memory()
    dx, dy = mem.alloc_array(x), mem.alloc(4 * n)
    simt_run(m.emit(), grid=(1,), block=(n,), params=dict(x=dx, y=dy), memory=mem)
    y = mem.read(dy, dt, n)
    fn = {"add": np.add, "min": np.minimum, "max": np.maximum, "and": np.bitwise_and, "or": np.bitwise_or,
          "xor": np.bitwise_xor}[op]
    for w in range(warps):
        lanes = x[32 * w:32 * w + 32].astype(np.int64)
        want = fn.reduce(lanes) & 0xFFFFFFFF
        got = y[32 * w:32 * w + 32].astype(np.int64) & 0xFFFFFFFF
        assert (got == want).all(), (op, t, w)
