"""Memory and synchronisation instructions of :class:`~ptx_gen.builder.KernelBuilder`: loads, stores,
atomics, asynchronous and bulk copies with their barriers, shared-memory arrays, warp collectives,
block barriers, and the tensor-core ``ldmatrix``/``mma`` forms."""

from __future__ import annotations

from typing import Sequence

from ptx_gen.operands import L2_EVICT, PREFETCH_SIZES, SHUFFLE_MODES, SPACES, Operand, Reg, Symbol, Var
from ptx_gen.types import PtxType, ptx_type


class MemoryOps:
    """Mixed into :class:`~ptx_gen.builder.KernelBuilder`; uses its ``reg``, ``_emit``, ``_op``,
    ``_type_of`` and ``target``."""

    # ---- memory ---------------------------------------------------------------------------------
    @staticmethod
    def _address(addr: Reg | Symbol, offset: int) -> str:
        if offset:
            return f"[{addr}{offset:+d}]"
        return f"[{addr}]"

    def load(
        self,
        space: str,
        t: str | PtxType,
        addr: Reg | Symbol,
        offset: int = 0,
        *,
        vec: int = 1,
        nc: bool = False,
        pred: Reg | None = None,
        other: Operand | None = None,
        cache: str | None = None,
        into: Sequence[Var] | None = None,
    ) -> Reg | tuple[Reg, ...]:
        """``ld.<space>[.nc][.v2|.v4].<t>``; with ``pred`` the load is guarded and the result
        holds ``other`` (which must be given) where the guard is false.

        ``into`` (``vec`` :class:`Var` s) loads into existing loop-carried registers instead of fresh
        ones, e.g. to prefetch the next iteration's data while this one is computed; a guarded load
        into them may omit ``other`` (they then keep their value where the guard is false)."""
        t = ptx_type(t)
        if space not in SPACES:
            raise ValueError(f"unknown state space {space!r}; expected one of {SPACES}")
        if vec not in (1, 2, 4):
            raise ValueError(f"vector width must be 1, 2 or 4, got {vec}")
        if nc and space != "global":
            raise ValueError("ld.nc exists only for the global space")
        if into is not None:
            into = list(into)
            if len(into) != vec or not all(isinstance(v, Var) and v.type.reg_class == t.reg_class for v in into):
                raise TypeError(f"into= needs {vec} Var(s) of register class {t.reg_class.decl}")
        if pred is not None and other is None and into is None:
            raise ValueError("a predicated load needs `other`, the value where the guard is false")
        dests = into if into is not None else [self.reg(t) for _ in range(vec)]
        if pred is not None and other is not None:
            for d in dests:
                self._emit(f"mov.{self._mov_type(t)} {d}, {self._op(other, t)};")
        qual = f".{space}" + (".nc" if nc else "") + (f".{cache}" if cache else "")
        qual += f".v{vec}" if vec > 1 else ""
        dst = f"{{{', '.join(map(str, dests))}}}" if vec > 1 else str(dests[0])
        self._emit(f"ld{qual}.{t.name} {dst}, {self._address(addr, offset)};", pred)
        return tuple(dests) if vec > 1 else dests[0]

    def store(
        self,
        space: str,
        t: str | PtxType,
        addr: Reg | Symbol,
        value: Operand | Sequence[Operand],
        offset: int = 0,
        *,
        pred: Reg | None = None,
        negate: bool = False,
    ) -> None:
        """``st.<space>[.v2|.v4].<t>``; pass a sequence of 2 or 4 values for a vector store."""
        t = ptx_type(t)
        if space not in SPACES:
            raise ValueError(f"unknown state space {space!r}; expected one of {SPACES}")
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(values) not in (1, 2, 4):
            raise ValueError(f"vector width must be 1, 2 or 4, got {len(values)}")
        ops = [self._op(v, t) for v in values]
        src = f"{{{', '.join(ops)}}}" if len(ops) > 1 else ops[0]
        vq = f".v{len(ops)}" if len(ops) > 1 else ""
        self._emit(f"st.{space}{vq}.{t.name} {self._address(addr, offset)}, {src};", pred, negate)

    def atom(
        self,
        space: str,
        op: str,
        t: str | PtxType,
        addr: Reg | Symbol,
        value: Operand,
        offset: int = 0,
        compare: Operand | None = None,
    ) -> Reg:
        """``atom.<space>.<op>.<t>``, returning the old value; ``op='cas'`` needs ``compare``."""
        t = ptx_type(t)
        d = self.reg(t)
        if op == "cas":
            if compare is None:
                raise ValueError("atom.cas needs `compare`")
            self._emit(
                f"atom.{space}.cas.{t.name} {d}, {self._address(addr, offset)}, "
                f"{self._op(compare, t)}, {self._op(value, t)};"
            )
        else:
            self._emit(f"atom.{space}.{op}.{t.name} {d}, {self._address(addr, offset)}, {self._op(value, t)};")
        return d

    def red(self, space: str, op: str, t: str | PtxType, addr: Reg | Symbol, value: Operand, offset: int = 0) -> None:
        """Fire-and-forget atomic reduction (``red.<space>.<op>.<t>``)."""
        t = ptx_type(t)
        self._emit(f"red.{space}.{op}.{t.name} {self._address(addr, offset)}, {self._op(value, t)};")

    def prefetch_l2(self, addr: Reg, nbytes: Operand) -> None:
        """``cp.async.bulk.prefetch.L2.global``: ask the L2 to fetch ``nbytes`` (a multiple of 16) from
        the 16-byte aligned global ``addr`` (sm_90+; a hint with no effect on results)."""
        self._need_sm90("cp.async.bulk.prefetch.L2")
        self._emit(f"cp.async.bulk.prefetch.L2.global [{addr}], {self._op(nbytes, ptx_type('u32'))};")

    def cp_async(self, dst: Reg, src: Reg, pred: Reg | None = None, dst_offset: int = 0, src_offset: int = 0,
                 *, prefetch: str | None = None, policy: Reg | None = None, src_size: Reg | None = None) -> None:
        """``cp.async.cg.shared.global [dst], [src], 16``: copy 16 bytes (both addresses 16-byte aligned)
        from global to shared memory without passing through registers, bypassing L1 (sm_80+). The
        copy lands at some point before this thread's :meth:`cp_async_wait_all`; other threads see it
        after a barrier that follows the wait.

        Hints that change no result: ``prefetch`` ("64B", "128B" or "256B", ``.L2::<size>``) lets the L2
        fetch that much around the 16 bytes on a miss; ``policy`` (from :meth:`create_policy`,
        ``.L2::cache_hint``) says how the L2 should keep the bytes.

        ``src_size`` (a u32 register, 0..16): only that many bytes are read from ``src``; the rest of the
        16 shared bytes are zero-filled (a tail or an out-of-range row costs no branch)."""
        hints = ""
        if policy is not None:
            if not isinstance(policy, Reg) or policy.type.bits != 64:
                raise TypeError(f"policy must be a 64-bit register from create_policy, got {policy!r}")
            hints += ".L2::cache_hint"
        if prefetch is not None:
            if prefetch not in PREFETCH_SIZES:
                raise ValueError(f"prefetch must be one of {PREFETCH_SIZES}, got {prefetch!r}")
            hints += f".L2::{prefetch}"
        tail = f", {src_size}" if src_size is not None else ""
        tail += f", {policy}" if policy is not None else ""
        self._emit(f"cp.async.cg.shared.global{hints} {self._address(dst, dst_offset)}, "
                   f"{self._address(src, src_offset)}, 16{tail};", pred)

    def cp_async4(self, dst: Reg, src: Reg, pred: Reg | None = None, dst_offset: int = 0, src_offset: int = 0) -> None:
        """``cp.async.ca.shared.global [dst], [src], 4``: copy 4 bytes (both addresses 4-byte aligned) through
        L1, for gathers whose pieces land apart (sm_80+)."""
        self._emit(f"cp.async.ca.shared.global {self._address(dst, dst_offset)}, {self._address(src, src_offset)}, 4;",
                   pred)

    def cp_async_mbarrier_arrive(self, addr: Reg, pred: Reg | None = None) -> None:
        """``cp.async.mbarrier.arrive.noinc``: arrive at the shared mbarrier once every cp.async this thread
        issued so far has landed (the arrival is one of the barrier's expected count)."""
        self._emit(f"cp.async.mbarrier.arrive.noinc.shared::cta.b64 [{addr}];", pred)

    def create_policy(self, evict: str = "evict_first", fraction: float = 1.0) -> Reg:
        """``createpolicy.fractional.L2::<evict>.b64``: an L2 cache policy (sm_80+) for the given
        ``fraction`` (0, 1] of the accesses that use it, e.g. ``evict_first`` for data streamed once."""
        if evict not in L2_EVICT:
            raise ValueError(f"evict must be one of {L2_EVICT}, got {evict!r}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
        d = self.reg("b64")
        self._emit(f"createpolicy.fractional.L2::{evict}.b64 {d}, {float(fraction)!r};")
        return d

    def grid_dependency_wait(self) -> None:
        """Place the ``griddepcontrol.wait`` of programmatic dependent launch here instead of at the
        kernel's entry (sm_90+; nothing on older targets, whose launches are never programmatic).

        Code before it overlaps the end of the kernel this one depends on, so it may only read memory
        no earlier kernel writes (weights) and write nothing but shared memory; every thread that goes
        on to touch other global memory must pass a wait. A second wait on a path is harmless. Data an
        earlier kernel writes must be read with coherent loads, never ``ld.global.nc``: its promise
        that the data is read-only for the kernel's lifetime lets ptxas move such a load above the
        wait (found on the GPU: decode went wrong once weight loads preceded the wait)."""
        self._deferred_wait = True
        if self.target.compute_capability >= (9, 0):
            self._emit("griddepcontrol.wait;")

    def launch_dependents(self, pred: Reg | None = None) -> None:
        """Place the ``griddepcontrol.launch_dependents`` of programmatic dependent launch here instead of
        at the kernel's entry (sm_90+; nothing on older targets): the next kernel's CTAs may be scheduled
        once every CTA of this one has executed it (where ``pred`` holds) or exited. Placed late, the
        next kernel's prologue (its weight copies) overlaps this one's last work without its CTAs taking
        SMs, or bandwidth, from this one's start. A second trigger on a path is harmless."""
        self._deferred_trigger = True
        if self.target.compute_capability >= (9, 0):
            self._emit(f"{'@' + pred.name + ' ' if pred is not None else ''}griddepcontrol.launch_dependents;")

    def cp_async_commit(self) -> None:
        """``cp.async.commit_group``: close this thread's group of cp.async copies issued so far."""
        self._emit("cp.async.commit_group;")

    def cp_async_wait_group(self, pending: int) -> None:
        """``cp.async.wait_group N``: all but this thread's newest ``pending`` committed groups have
        landed (a ring of ``pending + 1`` stages in flight)."""
        self._emit(f"cp.async.wait_group {int(pending)};")

    # ---- bulk copies (sm_90): the tensor memory accelerator, completion through an mbarrier ----------
    def _need_sm90(self, what: str) -> None:
        if self.target.compute_capability < (9, 0):
            raise ValueError(f"{what} needs sm_90 or newer, the target is {self.target}")

    def mbarrier_init(self, addr: Reg, count: int, pred: Reg | None = None) -> None:
        """``mbarrier.init``: an 8-byte shared barrier expecting ``count`` arrivals per phase."""
        self._need_sm90("mbarrier with transaction counts")
        self._emit(f"mbarrier.init.shared::cta.b64 [{addr}], {int(count)};", pred)

    def mbarrier_arrive(self, addr: Reg, pred: Reg | None = None) -> None:
        """``mbarrier.arrive`` (release, CTA scope): one of the barrier's expected arrivals for its phase."""
        self._emit(f"mbarrier.arrive.shared::cta.b64 _, [{addr}];", pred)

    def fence_mbarrier_init(self) -> None:
        """Make mbarrier initialisations visible to the other threads and to the bulk-copy unit."""
        self._emit("fence.mbarrier_init.release.cluster;")

    # ---- clusters (sm_90): a CTA addresses its cluster's shared memories and mbarriers ------------------------
    def cluster_rank(self) -> Reg:
        """``%cluster_ctarank``: this CTA's rank in its cluster."""
        return self.sreg("cluster_ctarank")

    def mapa(self, addr: Reg, rank: Operand) -> Reg:
        """``mapa.shared::cluster``: the shared::cluster address of shared address ``addr`` in the CTA of ``rank``."""
        self._need_sm90("mapa")
        d = self.reg("u32")
        self._emit(f"mapa.shared::cluster.u32 {d}, {addr}, {self._op(rank, ptx_type('u32'))};")
        return d

    def mbarrier_arrive_cluster(self, addr: Reg, pred: Reg | None = None) -> None:
        """``mbarrier.arrive`` (release, cluster scope) on the barrier at shared::cluster address ``addr`` (another
        CTA's, from :meth:`mapa`)."""
        self._emit(f"mbarrier.arrive.release.cluster.shared::cluster.b64 _, [{addr}];", pred)

    def cluster_sync(self) -> None:
        """``barrier.cluster.arrive`` (release) then ``barrier.cluster.wait`` (acquire), every thread of the cluster:
        what each did before is visible to all after (the mbarriers' initialisation, before remote arrivals)."""
        self._need_sm90("barrier.cluster")
        self._emit("barrier.cluster.arrive.release.aligned;")
        self._emit("barrier.cluster.wait.acquire.aligned;")

    def fence_proxy_async(self) -> None:
        """Order this thread's earlier shared-memory accesses before later bulk copies (async proxy)."""
        self._emit("fence.proxy.async.shared::cta;")

    def cp_async_bulk_tensor_2d(self, dst: Reg, tmap: Reg, c0: Operand, c1: Operand, mbar: Reg,
                                pred: Reg | None = None, multicast: Operand | None = None) -> None:
        """``cp.async.bulk.tensor.2d`` global -> shared: the box of the tensor map at generic address ``tmap``
        (:meth:`param_address` of a tensor-map parameter) whose first element is at coordinates (``c0``
        innermost, ``c1``), into ``dst`` laid out as the map says (its swizzle), completing its bytes on the
        mbarrier ``mbar`` (announce them with :meth:`mbarrier_expect_tx`). Elements outside the tensor land as
        zeros (sm_90). ``multicast``: a 16-bit mask of cluster ranks; the box lands at ``dst`` in each of their CTAs
        and completes its bytes on each one's barrier at ``mbar``."""
        self._need_sm90("cp.async.bulk.tensor")
        u32 = ptx_type("u32")
        form, mask = "", ""
        if multicast is not None:
            form, mask = ".multicast::cluster", f", {self._op(multicast, ptx_type('u16'))}"
        self._emit(f"cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes{form} [{dst}], "
                   f"[{tmap}, {{{self._op(c0, u32)}, {self._op(c1, u32)}}}], [{mbar}]{mask};", pred)

    def mbarrier_expect_tx(self, addr: Reg, nbytes: Operand, pred: Reg | None = None) -> None:
        """Arrive at the barrier, announcing ``nbytes`` that bulk copies will complete in this phase."""
        self._emit(f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [{addr}], {self._op(nbytes, ptx_type('u32'))};",
                   pred)

    def cp_async_bulk(self, dst: Reg, src: Reg, nbytes: int, mbar: Reg, pred: Reg | None = None,
                      policy: Reg | None = None) -> None:
        """``cp.async.bulk`` global -> shared of ``nbytes`` (a multiple of 16; both addresses 16-byte
        aligned) by the tensor memory accelerator; its bytes count towards the phase of ``mbar``.
        ``policy`` (from :meth:`create_policy`): an L2 cache hint for the bytes read."""
        self._need_sm90("cp.async.bulk")
        if policy is not None and (not isinstance(policy, Reg) or policy.type.bits != 64):
            raise TypeError(f"policy must be a 64-bit register from create_policy, got {policy!r}")
        hint, tail = (".L2::cache_hint", f", {policy}") if policy is not None else ("", "")
        self._emit(f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes{hint} [{dst}], [{src}], "
                   f"{int(nbytes)}, [{mbar}]{tail};", pred)

    def mbarrier_wait(self, addr: Reg, parity: Operand) -> None:
        """Spin until the barrier's phase of ``parity`` (0 or 1) has completed (its arrivals and bytes)."""
        ok = self.reg("pred")
        top = self.new_label("mbar_wait")
        self.label(top)
        self._emit(f"mbarrier.try_wait.parity.shared::cta.b64 {ok}, [{addr}], {self._op(parity, ptx_type('u32'))};")
        self.bra(top, ok, negate=True)

    def ldmatrix_x4(self, addr: Reg, offset: int = 0, trans: bool = False) -> tuple[Reg, Reg, Reg, Reg]:
        """``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` (warp-collective, sm_75+): four 8x8 matrices of
        16-bit elements, i.e. 8 rows of 16 bytes each; lane ``8 j + r`` gives the (16-byte aligned)
        shared address of row ``r`` of matrix ``j``. Lane ``l`` receives, for each matrix, bytes
        ``4 (l % 4) .. 4 (l % 4) + 3`` of row ``l / 4``: register ``j`` from matrix ``j``. With ``trans``
        (``.trans``) it receives the transposed matrix's: elements ``2 (l % 4)`` and ``2 (l % 4) + 1``
        of column ``l / 4`` (an MMA's B fragment from a row-major K x N tile)."""
        ds = tuple(self.reg("b32") for _ in range(4))
        form = ".trans" if trans else ""
        self._emit(f"ldmatrix.sync.aligned.m8n8.x4{form}.shared.b16 {{{', '.join(map(str, ds))}}}, "
                   f"{self._address(addr, offset)};")
        return ds

    def mma_s8(self, a: Sequence[Reg], b: Sequence[Reg], c: Sequence[Operand],
               a_unsigned: bool = False) -> tuple[Reg, Reg, Reg, Reg]:
        """``mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32`` (warp-collective, sm_80+): D = A B + C
        exactly in int32, A 16x32 and B 32x8 of signed bytes (``a_unsigned``: A's bytes are unsigned,
        ``.u8.s8``). With ``g = lane / 4``, ``t = lane % 4``:
        a[0] = A[g][4t..4t+3], a[1] = A[g+8][4t..4t+3], a[2] = A[g][16+4t..], a[3] = A[g+8][16+4t..]
        (4 bytes each, lowest k in the lowest byte); b[0] = B[4t..4t+3][g], b[1] = B[16+4t..16+4t+3][g];
        c and d: [g][2t], [g][2t+1], [g+8][2t], [g+8][2t+1]."""
        if len(a) != 4 or len(b) != 2 or len(c) != 4:
            raise ValueError("mma m16n8k32 takes 4 A, 2 B and 4 C registers")
        s32 = ptx_type("s32")
        cs = [x if isinstance(x, Reg) else self.mov(x, "s32") for x in c]
        ds = tuple(self.reg(s32) for _ in range(4))
        fmt = lambda regs: "{" + ", ".join(map(str, regs)) + "}"  # noqa: E731
        atype = "u8" if a_unsigned else "s8"
        self._emit(f"mma.sync.aligned.m16n8k32.row.col.s32.{atype}.s8.s32 {fmt(ds)}, {fmt(a)}, {fmt(b)}, {fmt(cs)};")
        return ds

    def mma_f16(self, a: Sequence[Reg], b: Sequence[Reg], c: Sequence[Operand],
                into: Sequence[Reg] | None = None) -> tuple[Reg, ...]:
        """``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (warp-collective, sm_80+): D = A B + C,
        A 16x16 and B 16x8 of f16 (two per 32-bit register, lower k in the low half), C and D f32.
        With ``g = lane / 4``, ``t = lane % 4``: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..],
        a[2] = A[g][8+2t..], a[3] = A[g+8][8+2t..]; b[0] = B[2t..2t+1][g], b[1] = B[8+2t..8+2t+1][g];
        c and d: [g][2t], [g][2t+1], [g+8][2t], [g+8][2t+1]. ``into`` (four f32 :class:`Var`) makes D
        those registers, so an accumulator stays in place (``c`` may be the same four)."""
        if len(a) != 4 or len(b) != 2 or len(c) != 4:
            raise ValueError("mma m16n8k16 takes 4 A, 2 B and 4 C registers")
        f32 = ptx_type("f32")
        cs = [x if isinstance(x, Reg) else self.mov(float(x), "f32") for x in c]
        if into is not None:
            if len(into) != 4 or any(not isinstance(v, Var) or v.type.name != "f32" for v in into):
                raise TypeError("into must be four f32 Vars")
            ds = tuple(into)
        else:
            ds = tuple(self.reg(f32) for _ in range(4))
        fmt = lambda regs: "{" + ", ".join(map(str, regs)) + "}"  # noqa: E731
        self._emit(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {fmt(ds)}, {fmt(a)}, {fmt(b)}, {fmt(cs)};")
        return ds

    # ---- warpgroup MMA (sm_90a) ------------------------------------------------------------------------
    def _need_sm90a(self, what: str) -> None:
        if self.target.sm != "sm_90a":
            raise ValueError(f"{what} needs the sm_90a target, the target is {self.target}")

    def wgmma_fence(self) -> None:
        """``wgmma.fence``: order this warp's register writes (A fragments, accumulators) before the next
        ``wgmma.mma_async`` reads them."""
        self._need_sm90a("wgmma")
        self._emit("wgmma.fence.sync.aligned;")

    def wgmma_commit(self) -> None:
        """Close the group of the ``wgmma.mma_async`` issued since the last commit."""
        self._emit("wgmma.commit_group.sync.aligned;")

    def wgmma_wait(self, pending: int) -> None:
        """Wait until at most ``pending`` committed wgmma groups are in flight (their accumulators and A
        registers may be touched again)."""
        self._emit(f"wgmma.wait_group.sync.aligned {int(pending)};")

    def wgmma_f16(self, acc: Sequence[Reg], a: Sequence[Reg], b_desc: Reg, scale_d: Reg) -> None:
        """``wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16`` (warpgroup-collective, sm_90a), A from
        registers: D += A B, N = 2 len(acc) (``acc``: N / 2 f32 Vars a thread).
        Warp ``w`` of the warpgroup gives rows ``16 w ..`` of A in the m16n8k16 A layout (``a``: 4 words);
        B (16 x N, K-major) is read from shared memory through the 64-bit descriptor ``b_desc``;
        ``scale_d`` (pred): false drops D's old value. acc[4 j + e]: the m16n8 C fragment of columns
        ``8 j ..`` (e: [g][2t], [g][2t+1], [g+8][2t], [g+8][2t+1])."""
        self._need_sm90a("wgmma")
        n = 2 * len(acc)
        if len(a) != 4 or n % 8 or not 8 <= n <= 256:
            raise ValueError(f"wgmma m64nNk16 takes 4 A words and N/2 accumulators with N in 8..256, got {n}")
        if any(not isinstance(v, Var) or v.type.name != "f32" for v in acc):
            raise TypeError("acc must be f32 Vars")
        fmt = lambda regs: "{" + ", ".join(map(str, regs)) + "}"  # noqa: E731
        self._emit(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {fmt(acc)}, {fmt(a)}, {b_desc}, "
                   f"{scale_d}, 1, 1, 0;")

    def wgmma_f16_ss(self, acc: Sequence[Reg], a_desc: Reg, b_desc: Reg, scale_d: Reg) -> None:
        """``wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16`` with both operands in shared memory (sm_90a):
        D += A B, A (64 x 16, K-major) and B (16 x N, K-major) read through the 64-bit descriptors ``a_desc``
        and ``b_desc``; ``acc`` as :meth:`wgmma_f16` (warp ``w`` of the warpgroup holds D's rows ``16 w ..``)."""
        self._need_sm90a("wgmma")
        n = 2 * len(acc)
        if n % 8 or not 8 <= n <= 256:
            raise ValueError(f"wgmma m64nNk16 takes N/2 accumulators with N in 8..256, got {n}")
        if any(not isinstance(v, Var) or v.type.name != "f32" for v in acc):
            raise TypeError("acc must be f32 Vars")
        regs = "{" + ", ".join(map(str, acc)) + "}"
        self._emit(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {regs}, {a_desc}, {b_desc}, "
                   f"{scale_d}, 1, 1, 0, 0;")

    def cp_async_wait_all(self) -> None:
        """``cp.async.wait_all``: every cp.async this thread issued has landed in shared memory."""
        self._emit("cp.async.wait_all;")

    def shared_array(self, name: str, t: str | PtxType, count: int, align: int = 16) -> Reg:
        """Declare a static shared array in this kernel and return its 32-bit shared address."""
        t = ptx_type(t)
        nbytes = t.nbytes * count
        self._shared_decls.append(f".shared .align {align} .b8 {name}[{nbytes}];")
        return self.mov(Symbol(name), "u32")

    def dynamic_shared(self, align: int = 16) -> Reg:
        """The 32-bit address of this kernel's dynamic shared memory (size set at launch)."""
        sym = f"{self.name}_dyn_smem"
        decl = f".extern .shared .align {align} .b8 {sym}[];"
        if decl not in self._module_decls:
            self._module_decls.append(decl)
        return self.mov(Symbol(sym), "u32")

    # ---- warp and block collectives ------------------------------------------------------------
    def shfl(self, mode: str, value: Reg, lane: Operand, clamp: int | None = None, mask: int = 0xFFFFFFFF) -> Reg:
        """``shfl.sync.<mode>.b32``; ``lane`` is the delta (down/up), xor mask (bfly) or source (idx)."""
        if mode not in SHUFFLE_MODES:
            raise ValueError(f"unknown shuffle mode {mode!r}; expected one of {SHUFFLE_MODES}")
        if value.type.bits != 32:
            raise TypeError(f"shfl moves 32-bit values, got {value.type}")
        if clamp is None:
            clamp = 0 if mode == "up" else 0x1F
        d = self.reg(value.type)
        u32 = ptx_type("u32")
        self._emit(
            f"shfl.sync.{mode}.b32 {d}, {value}, {self._op(lane, u32)}, {self._op(clamp, u32)}, "
            f"{self._op(mask, u32)};"
        )
        return d

    def redux(self, value: Reg, op: str = "max") -> Reg:
        """``redux.sync.<op>`` over the whole warp (sm_80+): one instruction for a 32-bit integer
        add/min/max/and/or/xor that every lane receives (``value``: u32 or s32)."""
        if op not in ("add", "min", "max", "and", "or", "xor"):
            raise ValueError(f"unknown redux op {op!r}")
        if value.type.name not in ("u32", "s32", "b32"):
            raise TypeError(f"redux reduces 32-bit integers, got {value.type}")
        t = "b32" if op in ("and", "or", "xor") else ("s32" if value.type.name == "s32" else "u32")
        d = self.reg(value.type)
        self._emit(f"redux.sync.{op}.{t} {d}, {value}, 0xffffffff;")
        return d

    def warp_reduce(self, value: Reg, op: str = "add", width: int = 32) -> Reg:
        """Butterfly reduction over ``width`` lanes; every lane receives the result (``"max_nan"``: a
        float max that a NaN wins)."""
        fn = {"add": self.add, "max": self.max, "min": self.min,
              "max_nan": lambda a, b: self.max(a, b, nan=True)}[op]
        acc = value
        offset = width // 2
        while offset >= 1:
            acc = fn(acc, self.shfl("bfly", acc, offset))
            offset //= 2
        return acc

    def bar_sync(self, barrier: int = 0, threads: int | None = None) -> None:
        extra = f", {threads}" if threads is not None else ""
        self._emit(f"bar.sync {barrier}{extra};")

    def fence(self, scope: str = "gl") -> None:
        """``membar.<cta|gl|sys>``."""
        self._emit(f"membar.{scope};")

    def bar_warp_sync(self, mask: int = 0xFFFFFFFF) -> None:
        """``bar.warp.sync``: the lanes in ``mask`` wait for each other (and their shared-memory
        writes become visible to each other)."""
        self._emit(f"bar.warp.sync {self._op(mask, ptx_type('u32'))};")
