"""GGUF models split into several files (realizar.models.gguf_split): read from any part, equal to the one-file
model; a missing part, parts out of order, a wrong tensor count or a part not named as gguf-split names them
are one-line ModelFormatErrors."""

from __future__ import annotations

import numpy as np
import pytest

from realizar.errors import ModelFormatError
from realizar.models.gguf_split import read_gguf_parts, unsplit_stem
from realizar.models.loader import load_model
from tests.gguf_factory import make_gguf_model, rewrite_gguf


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """(the one-file model, its split copy's parts): 3 parts of at most 8 tensors."""
    d = tmp_path_factory.mktemp("split")
    src, _, _ = make_gguf_model("llama", d / "one", qtype="Q4_0", seed=5)
    (d / "parts").mkdir()
    first = rewrite_gguf(src, d / "parts" / "tiny-Q4_0.gguf", split_max_tensors=8)
    return src, sorted(first.parent.glob("tiny-Q4_0-*-of-*.gguf"))


def test_a_split_model_equals_the_one_file_model_from_any_part(split):
    src, parts = split
    assert len(parts) == 3 and parts[0].name == "tiny-Q4_0-00001-of-00003.gguf"
    one = load_model(src)
    for part in parts:
        got = load_model(part)
        assert got.path == parts[0] and got.config == one.config
        assert sorted(got.tensors) == sorted(one.tensors)
        for name, t in one.tensors.items():
            assert got.tensors[name].shape == t.shape and got.tensors[name].ggml_type == t.ggml_type
            assert np.array_equal(got.tensors[name].data, t.data), name
    assert [len(f.tensor_infos) for f in read_gguf_parts(parts[1])] == [8, 8, len(one.tensors) - 16]


def test_a_split_model_generates_the_one_file_models_tokens(split):
    from realizar.engine import load_engine
    from realizar.generation import SamplingParams

    src, parts = split
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = load_engine(src, device="cpu").generate([1, 2, 3], params).token_ids
    assert load_engine(parts[2], device="cpu").generate([1, 2, 3], params).token_ids == want


def _copy(parts, tmp_path, skip=(), rename=None):
    out = []
    for p in parts:
        if p.name in skip:
            continue
        q = tmp_path / (rename(p.name) if rename else p.name)
        q.write_bytes(p.read_bytes())
        out.append(q)
    return out


def test_a_missing_part_is_named(split, tmp_path):
    _, parts = split
    copies = _copy(parts, tmp_path, skip=(parts[1].name,))
    with pytest.raises(ModelFormatError, match="tiny-Q4_0-00002-of-00003.gguf is not beside it") as e:
        load_model(copies[0])
    assert "\n" not in str(e.value)


def test_parts_out_of_order_are_refused(split, tmp_path):
    _, parts = split
    copies = _copy(parts, tmp_path)
    copies[1].write_bytes(parts[2].read_bytes())  # part 3's bytes under part 2's name
    with pytest.raises(ModelFormatError, match=r"00002-of-00003.gguf: split.no 2 of split.count 3, expected 1 of 3"):
        load_model(copies[0])


def test_a_wrong_tensor_count_is_refused(split, tmp_path):
    from gguf import GGUFValueType

    _, parts = split
    copies = _copy(parts, tmp_path)
    rewrite_gguf(parts[0], copies[0], set_metadata={"split.tensors.count": (99, GGUFValueType.INT32)})
    with pytest.raises(ModelFormatError, match="split.tensors.count says 99 tensors, the 3 parts hold"):
        load_model(copies[0])


def test_a_part_not_named_as_gguf_split_names_them(split, tmp_path):
    _, parts = split
    copies = _copy(parts, tmp_path, rename=lambda n: n.replace("-00001-of-00003", "-first"))
    with pytest.raises(ModelFormatError, match="not named PREFIX-0000K-of-00003.gguf"):
        load_model(copies[0])


def test_unsplit_stem():
    assert unsplit_stem("m-Q4_K_M-00001-of-00002.gguf") == "m-Q4_K_M"
    assert unsplit_stem("m-Q4_K_M.gguf") == "m-Q4_K_M"
