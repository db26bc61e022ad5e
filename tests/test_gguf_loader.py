"""GGUF loading: SmolLM2, tiny converted models of every architecture, and malformed files."""

from __future__ import annotations

import struct
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gguf_factory import hf_to_gguf, quantize, rewrite_gguf, unpermute_qk
from tests.model_factory import (
    ARCHS,
    BOS_ID,
    EOS_ID,
    KQUANT_DIMS,
    make_hf_model,
    read_hf_tensors,
)
from realizar.errors import ModelFormatError, RealizarError, UnsupportedError
from realizar.models.gguf_loader import load_gguf, read_gguf
from realizar.models.config import RopeScaling
from realizar.models.loaded import LoadedModel
from realizar.models.loader import load_model
from realizar.models.names import expected_shapes, hf_to_canonical
from tests.helpers import examples

# ------------------------------------------------------------------------------------ SmolLM2


@pytest.fixture(scope="module")
def smollm2_path():
    from realizar.default_model import default_model_path

    return default_model_path()


def test_smollm2_config(smollm2_path):
    m = load_model(smollm2_path)
    assert isinstance(m, LoadedModel) and m.format == "gguf" and m.tokenizer_json is None
    c = m.config
    assert c.architecture == "llama"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (64, 1536, 49152)
    assert c.rope_theta == 1e5 and c.rope_type == "normal"
    assert c.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert c.context_length == 8192
    assert c.tied_embeddings and not c.qkv_bias and not c.qk_norm
    assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id) == (1, (2,), 2)
    assert "output.weight" not in m.tensors
    assert "<|im_start|>" in m.chat_template
    md = m.metadata
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "smollm"
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and len(md["tokenizer.ggml.merges"]) == 48900
    assert all(isinstance(t, str) for t in md["tokenizer.ggml.tokens"][:100])
    types = {}
    for t in m.tensors.values():
        types[T(t.ggml_type).name] = types.get(T(t.ggml_type).name, 0) + 1
    assert types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert m.tensors["token_embd.weight"].shape == (49152, 576)
    assert m.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert m.tensors["blk.0.attn_k.weight"].shape == (192, 576)


def test_smollm2_agrees_with_gguf_reader(smollm2_path):
    """Our parser vs gguf.GGUFReader: every metadata value, every tensor's type, shape and bytes."""
    ours = read_gguf(smollm2_path)
    ref = gguf.GGUFReader(str(smollm2_path))
    ref_keys = {k for k in ref.fields if not k.startswith("GGUF.")}
    assert set(ours.metadata) == ref_keys
    assert ours.version == ref.fields["GGUF.version"].contents()
    for k in ref_keys:
        want = ref.fields[k].contents()
        if isinstance(want, float):
            assert ours.metadata[k] == pytest.approx(want, rel=0, abs=0), k
        else:
            assert ours.metadata[k] == want, k
    m = load_gguf(smollm2_path)
    assert len(m.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        q = m.tensors[t.name]
        assert q.ggml_type == int(t.tensor_type)
        assert q.shape == tuple(int(x) for x in reversed(t.shape))
        assert q.data.dtype == np.uint8 and not q.data.flags.writeable
        assert np.array_equal(q.data, np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
    w = m.tensors["blk.3.attn_q.weight"]
    ref_t = next(t for t in ref.tensors if t.name == "blk.3.attn_q.weight")
    assert np.array_equal(w.dequantize(), gguf.quants.dequantize(ref_t.data, ref_t.tensor_type))


def test_smollm2_loads_fast(smollm2_path):
    t0 = time.perf_counter()
    load_model(smollm2_path)
    assert time.perf_counter() - t0 < 2.0


# ------------------------------------------------------------------------ tiny factory models


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def hf_models(workdir):
    """One tiny HF model per architecture (default dims) and one with K-quant-friendly dims."""
    out = {}
    for arch in ARCHS:
        out[arch] = make_hf_model(arch, workdir, seed=ARCHS.index(arch))
    out["llama-k"] = make_hf_model("llama", workdir, seed=11, name="llama-k", **KQUANT_DIMS)
    out["qwen3-k"] = make_hf_model("qwen3", workdir, seed=12, name="qwen3-k", head_dim=128, **KQUANT_DIMS)
    return out


@pytest.fixture(scope="module")
def tiny_gguf(workdir, hf_models):
    """The default-dims llama model as an F32 GGUF (basis of the malformed-file tests)."""
    return hf_to_gguf(hf_models["llama"][0], workdir / "tiny-llama-f32.gguf", "F32")


def _expected_gguf_tensor(hf_name, x, cfg, arch_permutes):
    name = hf_to_canonical(hf_name)
    part = name.split(".")[-2]
    if arch_permutes and part == "attn_q":
        from tests.gguf_factory import permute_qk

        x = permute_qk(x, cfg.num_attention_heads)
    elif arch_permutes and part == "attn_k":
        from tests.gguf_factory import permute_qk

        x = permute_qk(x, cfg.num_key_value_heads)
    return name, x


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_tiny_models_all_archs(arch, qtype, workdir, hf_models):
    hf_dir, hf_model = hf_models[arch]
    path = hf_to_gguf(hf_dir, workdir / f"{arch}-{qtype}.gguf", qtype)
    m = load_model(path)
    c, hc = m.config, hf_model.config
    assert c.architecture == ("llama" if arch == "mistral" else arch)
    assert c.rope_type == ("normal" if arch in ("llama", "mistral") else "neox")
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (hc.vocab_size, hc.hidden_size, hc.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        hc.num_attention_heads,
        hc.num_key_value_heads,
        getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads,
    )
    assert c.intermediate_size == hc.intermediate_size
    assert c.qkv_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert not c.tied_embeddings
    assert c.rms_norm_eps == pytest.approx(hc.rms_norm_eps, rel=1e-6)
    assert c.context_length == hc.max_position_embeddings
    assert (c.bos_token_id, c.eos_token_ids) == (BOS_ID, (EOS_ID,))
    if arch == "qwen3":
        assert c.head_dim != c.hidden_size // c.num_heads
    assert set(expected_shapes(c)) <= set(m.tensors)
    # Every tensor equals the HF tensor, permuted like llama.cpp for llama-arch, encoded as qtype.
    permutes = arch in ("llama", "mistral")
    for hf_name, x in read_hf_tensors(hf_dir).items():
        name, x = _expected_gguf_tensor(hf_name, x, hc, permutes)
        t = m.tensors[name]
        assert t.shape == x.shape, name
        want_type = "F32" if x.ndim == 1 else qtype
        assert t.ggml_type == T[want_type], name
        got = t.dequantize()
        if want_type == "F32":
            assert np.array_equal(got, x), name
        else:
            raw, _ = quantize(x, want_type)
            want = gguf.quants.dequantize(np.asarray(raw).view(np.uint8), T[want_type])
            assert np.array_equal(got, want.reshape(x.shape)), name


def test_llama_qk_are_stored_permuted(workdir, hf_models):
    """The GGUF keeps llama Q/K as stored (interleaved); undoing llama.cpp's permutation gives HF's."""
    hf_dir, hf_model = hf_models["llama"]
    m = load_model(hf_to_gguf(hf_dir, workdir / "perm.gguf", "F32"))
    sd = hf_model.tensors
    q = m.tensors["blk.1.attn_q.weight"].dequantize()
    k = m.tensors["blk.1.attn_k.weight"].dequantize()
    assert not np.array_equal(q, sd["model.layers.1.self_attn.q_proj.weight"])
    assert np.array_equal(unpermute_qk(q, m.config.num_heads), sd["model.layers.1.self_attn.q_proj.weight"])
    assert np.array_equal(unpermute_qk(k, m.config.num_kv_heads), sd["model.layers.1.self_attn.k_proj.weight"])
    # and V is untouched
    assert np.array_equal(m.tensors["blk.1.attn_v.weight"].dequantize(), sd["model.layers.1.self_attn.v_proj.weight"])


@pytest.mark.parametrize("name", ["llama-k", "qwen3-k"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_models(name, qtype, workdir, hf_models):
    hf_dir, hf_model = hf_models[name]
    path = hf_to_gguf(hf_dir, workdir / f"{name}-{qtype}.gguf", qtype, embd_qtype="Q8_0")
    m = load_model(path)
    assert m.config.hidden_size == 256 and m.config.intermediate_size == 512
    if name == "qwen3-k":
        assert m.config.head_dim == 128 and m.config.q_dim == 512
    assert m.tensors["token_embd.weight"].ggml_type == T.Q8_0
    assert m.tensors["blk.0.ffn_down.weight"].ggml_type == T[qtype]
    sd = hf_model.tensors
    down = m.tensors["blk.1.ffn_down.weight"].dequantize()
    ref = sd["model.layers.1.mlp.down_proj.weight"]
    assert down.shape == ref.shape
    assert np.abs(down - ref).max() < 0.15 * np.abs(ref).max()


def test_mistral_architecture_name(workdir, hf_models):
    hf_dir, _ = hf_models["mistral"]
    m = load_model(hf_to_gguf(hf_dir, workdir / "mistral-arch.gguf", "F16", gguf_arch="mistral"))
    assert m.config.architecture == "mistral" and m.config.rope_type == "normal"


def test_tied_embeddings(workdir):
    hf_dir, _ = make_hf_model("qwen2", workdir, seed=5, name="qwen2-tied", tie_word_embeddings=True)
    m = load_model(hf_to_gguf(hf_dir, workdir / "tied.gguf", "Q8_0"))
    assert m.config.tied_embeddings and "output.weight" not in m.tensors


def test_load_model_dispatch_on_dir_with_single_gguf(workdir, tiny_gguf):
    d = workdir / "only-gguf"
    d.mkdir()
    (d / "m.gguf").write_bytes(tiny_gguf.read_bytes())
    assert load_model(d).format == "gguf"
    (d / "n.gguf").write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(ModelFormatError, match="holds 2 GGUF files"):
        load_model(d)
    with pytest.raises(FileNotFoundError):
        load_model(workdir / "does-not-exist.gguf")


def test_config_extras(workdir, tiny_gguf):
    p = rewrite_gguf(
        tiny_gguf,
        workdir / "extras.gguf",
        set_metadata={
            "llama.rope.scaling.type": "linear",
            "llama.rope.scaling.factor": 2.0,
            "tokenizer.ggml.eot_token_id": 0,
            "tokenizer.ggml.padding_token_id": 99999,
        },
    )
    c = load_model(p).config
    assert c.rope_scaling == RopeScaling("linear", factor=2.0)
    assert c.eos_token_ids == (EOS_ID, 0)
    assert c.pad_token_id is None and "padding_token_id" in c.extra["warnings"][0]


# ------------------------------------------------------------------------------ malformed input


def _header_end(path) -> int:
    f = read_gguf(path)
    return f.data_offset


def test_truncated_at_many_offsets(workdir, tiny_gguf):
    data = tiny_gguf.read_bytes()
    end = _header_end(tiny_gguf)
    rng = np.random.default_rng(0)
    offsets = sorted(
        set(range(0, 64))
        | set(range(0, end, 7))
        | set(int(x) for x in rng.integers(end, len(data), 60))
        | {end - 1, end, end + 1, len(data) - 1}
    )
    p = workdir / "trunc.gguf"
    for n in offsets:
        p.write_bytes(data[:n])
        with pytest.raises(ModelFormatError) as e:
            load_model(p)
        msg = str(e.value)
        assert "trunc" in msg or "not a GGUF file" in msg or "cannot fit" in msg or "does not fit" in msg, (n, msg)


def test_empty_file(workdir):
    p = workdir / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        load_model(p)


@pytest.mark.parametrize("magic", [b"GGML", b"ggUF", b"\x00\x00\x00\x00", b"FUGG"])
def test_wrong_magic(workdir, tiny_gguf, magic):
    p = workdir / "magic.gguf"
    p.write_bytes(magic + tiny_gguf.read_bytes()[4:])
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        load_model(p)


@pytest.mark.parametrize(
    "version,exc,match",
    [
        (1, UnsupportedError, "version 1"),
        (0x03000000, UnsupportedError, "big-endian"),
        (4, ModelFormatError, "unknown GGUF version 4"),
        (0, ModelFormatError, "unknown GGUF version 0"),
    ],
)
def test_bad_version(workdir, tiny_gguf, version, exc, match):
    data = bytearray(tiny_gguf.read_bytes())
    data[4:8] = struct.pack("<I", version)
    p = workdir / "version.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(exc, match=match):
        load_model(p)


@pytest.mark.parametrize("arch", ["gpt2", "falcon", "phi3", "LLAMA", "qwen2moe"])
def test_unknown_architecture(workdir, tiny_gguf, arch):
    p = rewrite_gguf(tiny_gguf, workdir / "arch.gguf", arch=arch)
    with pytest.raises(UnsupportedError, match=f"unsupported architecture '{arch}'"):
        load_model(p)


def test_missing_architecture_key(workdir, tiny_gguf):
    # rewrite_gguf always writes general.architecture; patch the key name in place instead
    data = bytearray(tiny_gguf.read_bytes())
    i = data.index(b"general.architecture")
    data[i : i + 7] = b"GENERAL"
    p = workdir / "noarch.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="general.architecture"):
        load_model(p)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K])
def test_unsupported_quant_type(workdir, tiny_gguf, qtype):
    x = read_gguf(tiny_gguf).tensor("blk.0.ffn_up.weight").dequantize()
    # pad rows to 256 so the K-quant is encodable, then fake the shape back via a new tensor name
    arr, raw = quantize(np.zeros((x.shape[0], 256), np.float32), qtype.name)
    p = rewrite_gguf(tiny_gguf, workdir / "unsup.gguf", replace_tensors={"blk.0.extra.weight": (arr, raw)})
    with pytest.raises(UnsupportedError, match=f"'blk.0.extra.weight' \\({qtype.name}\\)"):
        load_model(p)


def test_unknown_type_id(workdir, tiny_gguf):
    data = bytearray(tiny_gguf.read_bytes())
    name = b"token_embd.weight"
    i = data.index(name, 24 + 100)  # the tensor info (not a metadata string)
    i += len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    type_pos = i + 4 + 8 * n_dims
    struct.pack_into("<I", data, type_pos, 200)
    p = workdir / "typeid.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match="ggml type 200"):
        load_model(p)


@pytest.mark.parametrize("missing", ["blk.1.ffn_up.weight", "output_norm.weight", "blk.0.attn_k.weight"])
def test_missing_tensor(workdir, tiny_gguf, missing):
    p = rewrite_gguf(tiny_gguf, workdir / "missing.gguf", drop_tensors=(missing,))
    with pytest.raises(ModelFormatError, match=f"missing tensor '{missing}'"):
        load_model(p)


def test_missing_token_embd(workdir, tiny_gguf):
    p = rewrite_gguf(tiny_gguf, workdir / "noembd.gguf", drop_tensors=("token_embd.weight",))
    with pytest.raises(ModelFormatError, match="token_embd.weight"):
        load_model(p)


def test_wrong_tensor_shape(workdir, tiny_gguf):
    x = read_gguf(tiny_gguf).tensor("blk.1.ffn_gate.weight").dequantize()  # (128, 64)
    bad = np.zeros((x.shape[0] + 32, x.shape[1]), np.float32)
    p = rewrite_gguf(tiny_gguf, workdir / "shape.gguf", replace_tensors={"blk.1.ffn_gate.weight": (bad, None)})
    with pytest.raises(ModelFormatError, match=r"'blk.1.ffn_gate.weight' has shape \(160, 64\), expected \(128, 64\)"):
        load_model(p)


def test_vocab_size_mismatch(workdir, tiny_gguf):
    p = rewrite_gguf(tiny_gguf, workdir / "vocab.gguf", set_metadata={"llama.vocab_size": 1000})
    with pytest.raises(ModelFormatError, match="vocab_size"):
        load_model(p)


@pytest.mark.parametrize(
    "key,value,exc,match",
    [
        ("llama.block_count", 2**31 - 1, ModelFormatError, "block_count"),
        ("llama.block_count", 0, ModelFormatError, "block_count"),
        ("llama.attention.head_count", 3, ModelFormatError, "head count 3 is not a multiple"),
        ("llama.embedding_length", 2**40, ModelFormatError, "absurdly large"),
        ("llama.attention.head_count_kv", [2, 1], UnsupportedError, "varies per layer"),
        ("llama.rope.dimension_count", 8, UnsupportedError, "partial RoPE"),
        ("llama.rope.freq_base", float("nan"), ModelFormatError, "finite"),
        ("general.alignment", 24, ModelFormatError, "alignment"),
        ("llama.attention.key_length", 0, ModelFormatError, "key_length"),
    ],
)
def test_bad_metadata_values(workdir, tiny_gguf, key, value, exc, match):
    if isinstance(value, int) and value > 2**32:
        value = (value, gguf.GGUFValueType.UINT64)
    p = rewrite_gguf(tiny_gguf, workdir / "meta.gguf", set_metadata={key: value})
    with pytest.raises(exc, match=match):
        load_model(p)


def test_missing_required_key(workdir, tiny_gguf):
    p = rewrite_gguf(tiny_gguf, workdir / "nokey.gguf", drop_metadata=("llama.feed_forward_length",))
    with pytest.raises(ModelFormatError, match="llama.feed_forward_length"):
        load_model(p)


def _patch_u64_after(data: bytearray, marker: bytes, skip: int, value: int) -> bytearray:
    """Overwrite the u64 that sits ``skip`` bytes after the first occurrence of ``marker``."""
    i = data.index(marker) + len(marker) + skip
    struct.pack_into("<Q", data, i, value)
    return data


@pytest.mark.parametrize(
    "patch,match",
    [
        (lambda d: struct.pack_into("<Q", d, 8, 2**63) or d, "tensor count"),
        (lambda d: struct.pack_into("<Q", d, 16, 2**62) or d, "metadata count"),
        (lambda d: struct.pack_into("<Q", d, 8, 10**6) or d, "tensor count"),
        (lambda d: struct.pack_into("<Q", d, 24, 2**60) or d, "key of metadata entry 0"),  # first key's length
        # array count of tokenizer.ggml.tokens: key, value type u32, elem type u32, then count
        (lambda d: _patch_u64_after(d, b"tokenizer.ggml.tokens", 8, 2**61), "does not fit"),
        (lambda d: _patch_u64_after(d, b"tokenizer.ggml.token_type", 8, 2**40), "does not fit"),
        # the first token string's length
        (lambda d: _patch_u64_after(d, b"tokenizer.ggml.tokens", 16, 2**50), "truncated"),
        # tensor info of token_embd: n_dims, then the first dimension
        (lambda d: _patch_u64_after(d, b"token_embd.weight", 4, 2**62), "cannot fit"),
    ],
)
def test_absurd_sizes(workdir, tiny_gguf, patch, match):
    data = patch(bytearray(tiny_gguf.read_bytes()))
    p = workdir / "absurd.gguf"
    p.write_bytes(bytes(data))
    t0 = time.perf_counter()
    with pytest.raises(ModelFormatError, match=match):
        load_model(p)
    assert time.perf_counter() - t0 < 1.0


def test_absurd_n_dims(workdir, tiny_gguf):
    data = bytearray(tiny_gguf.read_bytes())
    i = data.index(b"token_embd.weight", 100) + len(b"token_embd.weight")
    struct.pack_into("<I", data, i, 1000)
    p = workdir / "ndims.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="1000 dimensions"):
        load_model(p)


def test_tensor_offset_past_end(workdir, tiny_gguf):
    data = bytearray(tiny_gguf.read_bytes())
    name = struct.pack("<Q", 13) + b"output.weight"  # its length prefix avoids attn_output
    i = data.index(name, 100) + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<Q", data, i + 4 + 8 * n_dims + 4, len(data) // 32 * 32)
    p = workdir / "offset.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="truncated: tensor 'output.weight'"):
        load_model(p)


def test_invalid_value_type(workdir, tiny_gguf):
    data = bytearray(tiny_gguf.read_bytes())
    key = b"general.architecture"
    i = data.index(key) + len(key)
    struct.pack_into("<I", data, i, 77)
    p = workdir / "vtype.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="invalid metadata value type 77"):
        load_model(p)


def test_not_a_file(workdir):
    with pytest.raises((ModelFormatError, FileNotFoundError, IsADirectoryError)):
        load_gguf(workdir / "nope.gguf")


@pytest.fixture(scope="module")
def tiny_bytes(tiny_gguf):
    data = tiny_gguf.read_bytes()
    return data, _header_end(tiny_gguf)


def _load_bytes(tmp_path_factory, data: bytes) -> None:
    p = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    p.write_bytes(data)
    t0 = time.perf_counter()
    try:
        load_model(p)
    except RealizarError:
        pass
    assert time.perf_counter() - t0 < 2.0


@settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_header_mutations(tmp_path_factory, tiny_bytes, data):
    """Random byte edits in the header: loads or raises a RealizarError, quickly."""
    raw, end = tiny_bytes
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, end - 1))
        kind = data.draw(st.sampled_from(["byte", "u32", "u64", "ff"]))
        if kind == "byte":
            buf[pos] = data.draw(st.integers(0, 255))
        elif kind == "ff":
            buf[pos : pos + 8] = b"\xff" * len(buf[pos : pos + 8])
        else:
            size = 4 if kind == "u32" else 8
            if pos + size <= len(buf):
                v = data.draw(st.sampled_from([0, 1, 2, 3, 255, 2**31, 2**32 - 1]) | st.integers(0, 2 ** (8 * size) - 1))
                buf[pos : pos + size] = v.to_bytes(size, "little")
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    _load_bytes(tmp_path_factory, bytes(buf))


@settings(max_examples=examples(100), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=512))
def test_fuzz_random_headers(tmp_path_factory, body):
    """Magic + version 3 + arbitrary bytes."""
    _load_bytes(tmp_path_factory, b"GGUF" + struct.pack("<I", 3) + body)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n_tensors=st.integers(0, 2**64 - 1),
    n_kv=st.integers(0, 2**64 - 1),
    key_len=st.integers(0, 2**64 - 1),
    vtype=st.integers(0, 2**32 - 1),
    tail=st.binary(max_size=64),
)
def test_fuzz_structured_headers(tmp_path_factory, n_tensors, n_kv, key_len, vtype, tail):
    head = b"GGUF" + struct.pack("<IQQQ", 3, n_tensors, n_kv, key_len) + b"k" * min(key_len, 16)
    _load_bytes(tmp_path_factory, head + struct.pack("<I", vtype) + tail)


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHS)
def test_factory_gguf_is_faithful_for_transformers(arch, workdir):
    """Oracle for the factory itself: transformers reading our GGUF (it un-permutes llama Q/K) gives
    the logits of transformers reading the HF directory the GGUF was made from — exactly for F32.
    (transformers ignores qwen3's attention.key_length and assumes head_dim 128, so the qwen3 model
    uses head_dim 128.)"""
    from tests.model_factory import hf_logits, load_hf_model

    dims = {"head_dim": 128} if arch == "qwen3" else {}
    hf_dir, _ = make_hf_model(arch, workdir, seed=21, name=f"oracle-{arch}", **dims)
    path = hf_to_gguf(hf_dir, workdir / f"oracle-{arch}.gguf", "F32")
    tf = load_hf_model(path.parent, gguf_file=path.name)
    ids = [1, 5, 70, 200, 33, 9, 100, 7]
    assert np.array_equal(hf_logits(tf, ids), hf_logits(load_hf_model(hf_dir), ids))
