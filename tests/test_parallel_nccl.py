"""The NCCL binding (realizar.parallel.nccl) on a CPU.

* Marshalling: a fake library whose functions are ctypes callbacks receives every argument after the
  same C conversion as the real library would (64-bit counts, pointers, enums, the 128-byte unique id
  by value, out-pointers written back), so a wrong prototype or argument order fails here.
* Error mapping: a non-zero ``ncclResult_t`` becomes NcclError with its name, ncclGetErrorString's text
  and ncclGetLastError's detail; bad arguments are refused before any call.
* The real ``libnccl.so.2`` (from the nvidia-nccl wheel, or REALIZAR_NCCL_LIBRARY): the prototypes
  against its own nccl.h, ncclGetVersion, ncclGetUniqueId, and real errors (a NULL communicator; no GPU
  for ncclCommInitAll). Skipped with the reason when the library cannot be loaded here.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from realizar.parallel import nccl
from realizar.parallel.nccl import SIGNATURES, Communicator, DataType, Nccl, NcclError, RedOp, Result, UniqueId

# -- a fake library of ctypes callbacks -----------------------------------------------------------

_STRINGS: dict[str, ctypes.Array] = {}


def _cstr(text: str) -> int:
    """Address of a NUL-terminated buffer that lives as long as the test module."""
    buf = _STRINGS.setdefault(text, ctypes.create_string_buffer(text.encode()))
    return ctypes.addressof(buf)


class FakeLib:
    """Every NCCL function of SIGNATURES as a ctypes callback recording ``(name, args)`` and returning
    ``self.result[name]`` (default ncclSuccess). char* results are returned as addresses."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.result: dict[str, int] = {}
        self._keep = []
        for name, (restype, argtypes) in SIGNATURES.items():
            proto = ctypes.CFUNCTYPE(ctypes.c_void_p if restype is ctypes.c_char_p else restype, *argtypes)
            fn = proto(self._impl(name))
            self._keep.append(fn)
            setattr(self, name, fn)

    def _impl(self, name):
        def impl(*args):
            self.calls.append((name, args))
            return getattr(self, "do_" + name, lambda *a: self.result.get(name, 0))(*args)

        return impl

    # out-parameters written back the way NCCL does
    def do_ncclGetVersion(self, out):
        out[0] = 23203
        return 0

    def do_ncclGetUniqueId(self, out):
        ctypes.memmove(out[0].internal, bytes(range(128)), 128)
        return 0

    def do_ncclCommInitRank(self, comm, nranks, uid, rank):
        comm[0] = 0x7000 + rank
        return self.result.get("ncclCommInitRank", 0)

    def do_ncclCommInitAll(self, comms, ndev, devlist):
        for i in range(ndev):
            comms[i] = 0x9000 + devlist[i]
        return 0

    def do_ncclCommUserRank(self, comm, out):
        out[0] = comm - 0x7000
        return 0

    def do_ncclGetErrorString(self, code):
        return _cstr(f"fake text of {code}")

    def do_ncclGetLastError(self, comm):
        return _cstr(f"fake detail for comm {comm}")


@pytest.fixture
def fake():
    lib = FakeLib()
    return lib, Nccl(lib, path="fake")


def test_collectives_reach_the_library_with_c_types(fake):
    lib, n = fake
    comm = Communicator(n, 0xC0FFEE)
    stream = SimpleNamespace(ptr=0xDEAD)
    n.all_reduce(SimpleNamespace(ptr=0x1000), 0x2000, 2**33, np.float16, comm, stream, op=RedOp.ncclMax)
    n.all_gather(0x3000, 0x4000, 17, "bf16", comm)  # null stream
    assert lib.calls == [
        ("ncclAllReduce", (0x1000, 0x2000, 2**33, DataType.ncclFloat16, RedOp.ncclMax, 0xC0FFEE, 0xDEAD)),
        ("ncclAllGather", (0x3000, 0x4000, 17, DataType.ncclBfloat16, 0xC0FFEE, None)),
    ]


def test_communicators_and_unique_ids(fake):
    lib, n = fake
    assert n.version() == (2, 32, 3)
    uid = n.unique_id()
    assert uid.to_bytes() == bytes(range(128)) and UniqueId.from_bytes(uid.to_bytes()).to_bytes() == uid.to_bytes()
    with n.group():
        comms = [n.comm_init_rank(2, uid, r) for r in range(2)]
    names = [c[0] for c in lib.calls]
    assert names[-4:] == ["ncclGroupStart", "ncclCommInitRank", "ncclCommInitRank", "ncclGroupEnd"]
    _, (_, nranks, passed_uid, rank) = lib.calls[-2]
    assert (nranks, rank) == (2, 1) and bytes(passed_uid.internal) == bytes(range(128))  # by value
    assert [c.handle for c in comms] == [0x7000, 0x7001] and comms[1].rank == 1
    all_comms = n.comm_init_all([3, 1])
    assert [c.handle for c in all_comms] == [0x9003, 0x9001]
    with all_comms[0] as c:
        pass
    assert not c.alive and lib.calls[-1] == ("ncclCommDestroy", (0x9003,))
    c.destroy()  # a second destroy does nothing
    assert lib.calls[-1] == ("ncclCommDestroy", (0x9003,))
    # several driven by this thread: all finalized in one group, then destroyed (the destroyed one left alone)
    more = n.comm_init_all([0, 1, 2])
    del lib.calls[:]
    n.destroy_all([c, *more])
    assert lib.calls == [("ncclGroupStart", ()), *[("ncclCommFinalize", (0x9000 + d,)) for d in range(3)],
                         ("ncclGroupEnd", ()), *[("ncclCommDestroy", (0x9000 + d,)) for d in range(3)]]
    assert not any(m.alive for m in more)
    with pytest.raises(NcclError, match="ncclInvalidUsage .*destroyed"):
        n.all_reduce(0, 0, 1, np.float32, c)


def test_a_failing_call_raises_with_name_text_and_detail(fake):
    lib, n = fake
    lib.result["ncclAllReduce"] = int(Result.ncclRemoteError)
    comm = Communicator(n, 0x55)
    with pytest.raises(NcclError) as e:
        n.all_reduce(1, 2, 3, np.float32, comm)
    err = e.value
    assert (err.call, err.code, err.name) == ("ncclAllReduce", 6, "ncclRemoteError")
    assert err.description == "fake text of 6" and err.detail == f"fake detail for comm {0x55}"
    assert str(err) == f"ncclAllReduce failed: ncclRemoteError (6): fake text of 6 [fake detail for comm {0x55}]"
    lib.result["ncclGroupEnd"] = 3
    with pytest.raises(NcclError, match="ncclGroupEnd failed: ncclInternalError"):
        with n.group():
            pass


def test_the_group_is_closed_when_its_block_raises(fake):
    lib, n = fake
    with pytest.raises(KeyError):
        with n.group():
            raise KeyError("boom")
    assert [c[0] for c in lib.calls] == ["ncclGroupStart", "ncclGroupEnd"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda n, c: n.all_reduce(0, 0, -1, np.float32, c), "count must be an integer >= 0, got -1"),
        (lambda n, c: n.all_reduce(0, 0, 4, np.complex64, c), "no data type for"),
        (lambda n, c: n.all_gather("x", 0, 4, np.float32, c), "send must be an address"),
        (lambda n, c: n.comm_init_rank(2, n.unique_id(), 2), "rank 2 is outside 0..1"),
        (lambda n, c: n.comm_init_rank(2, b"\0" * 128, 0), "must be a UniqueId, got bytes"),
        (lambda n, c: n.comm_init_all([0, 0]), "devices must be distinct"),
        (lambda n, c: n.comm_init_all([]), "at least one device"),
    ],
)
def test_bad_arguments_are_refused_before_calling_nccl(fake, call, message):
    lib, n = fake
    with pytest.raises(NcclError, match=message) as e:
        call(n, Communicator(n, 0x10))
    assert e.value.name == "ncclInvalidArgument"
    assert all(name == "ncclGetUniqueId" for name, _ in lib.calls)


def test_a_library_without_nccl_functions_is_refused():
    with pytest.raises(nccl.NcclUnavailableError, match="has no ncclGetVersion: not an NCCL 2 library"):
        Nccl(SimpleNamespace(), path="libfoo.so")


def test_library_lookup_order(monkeypatch, tmp_path):
    monkeypatch.setenv(nccl.LIBRARY_ENV, "/opt/x/libnccl.so.2")
    assert nccl.find_library() == ("/opt/x/libnccl.so.2", "$REALIZAR_NCCL_LIBRARY")
    monkeypatch.delenv(nccl.LIBRARY_ENV)
    monkeypatch.setattr(nccl, "_wheel_library", lambda: tmp_path / "libnccl.so.2")
    assert nccl.find_library() == (str(tmp_path / "libnccl.so.2"), "the nvidia-nccl wheel")
    monkeypatch.setattr(nccl, "_wheel_library", lambda: None)
    assert nccl.find_library() == ("libnccl.so.2", "the dynamic loader's search path")
    monkeypatch.setenv(nccl.LIBRARY_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(nccl.NcclUnavailableError, match=r"cannot load .*missing\.so from \$REALIZAR_NCCL_LIBRARY"):
        nccl.load()


# -- the real library -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    try:
        return nccl.load()
    except nccl.NcclUnavailableError as e:
        pytest.skip(f"{e}; or point REALIZAR_NCCL_LIBRARY at a libnccl.so.2")


_C_TYPES = {
    "int*": ctypes.POINTER(ctypes.c_int), "const int*": ctypes.POINTER(ctypes.c_int), "int": ctypes.c_int,
    "size_t": ctypes.c_size_t, "const void*": ctypes.c_void_p, "void*": ctypes.c_void_p,
    "ncclComm_t": ctypes.c_void_p, "const ncclComm_t": ctypes.c_void_p, "ncclComm_t*": ctypes.POINTER(ctypes.c_void_p),
    "ncclUniqueId": UniqueId, "ncclUniqueId*": ctypes.POINTER(UniqueId), "ncclDataType_t": ctypes.c_int,
    "ncclRedOp_t": ctypes.c_int, "cudaStream_t": ctypes.c_void_p, "ncclResult_t": ctypes.c_int,
    "const char*": ctypes.c_char_p,
}  # fmt: skip


def _c_type(text: str) -> str:
    """A C type spelled one way: ``int *`` -> ``int*``, runs of spaces as one."""
    return re.sub(r"\s+", " ", re.sub(r"\s*\*", "*", text)).strip()


def test_prototypes_match_the_librarys_header(real):
    header = Path(real.path).resolve().parent.parent / "include" / "nccl.h"
    if not header.is_file():
        pytest.skip(f"no nccl.h beside {real.path}")
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    for name, (restype, argtypes) in SIGNATURES.items():
        m = re.search(rf"^\s*(ncclResult_t|const char\s*\*)\s+{name}\s*\(([^)]*)\)\s*;", text, re.M)
        assert m, f"{name} not declared in {header}"
        assert _C_TYPES[_c_type(m.group(1))] is restype, name
        params = [p.strip() for p in m.group(2).split(",") if p.strip() and p.strip() != "void"]
        c_types = [_c_type(re.match(r"(.*?)\w+$", p, re.S).group(1)) for p in params]  # drop the name
        got = tuple(_C_TYPES[t] for t in c_types)
        assert got == argtypes, f"{name}: header {c_types}, binding {argtypes}"


def test_version_and_unique_id_of_the_real_library(real):
    major, minor, patch = real.version()
    assert major == 2 and minor >= 13, (major, minor, patch)  # ncclGetLastError exists from 2.13
    a, b = real.unique_id().to_bytes(), real.unique_id().to_bytes()
    assert len(a) == 128 and a != b


def test_the_real_library_reports_its_own_errors(real):
    with pytest.raises(NcclError) as e:
        real._call("ncclAllReduce", 0, 0, 4, int(DataType.ncclFloat32), 0, None, None)  # a NULL communicator
    assert e.value.name == "ncclInvalidArgument" and "invalid argument" in e.value.description
    assert "NULL" in e.value.detail


def test_comm_init_all_without_a_gpu_is_an_nccl_error(real):
    from realizar import cuda

    if cuda.is_available():
        pytest.skip("a GPU is present: ncclCommInitAll would succeed here")
    with pytest.raises(NcclError, match="ncclCommInitAll failed") as e:
        real.comm_init_all([0, 1])
    assert e.value.code != 0 and e.value.description == real.error_string(e.value.code)
