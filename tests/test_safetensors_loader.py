"""HF safetensors directories: every architecture, f32/f16/bf16, sharded, tied, and malformed input."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.gguf_factory import hf_to_gguf, unpermute_qk
from tests.model_factory import (
    ARCHS,
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    bf16_bits,
    make_hf_model,
)
from realizar.errors import ModelFormatError, UnsupportedError
from realizar.models.chat_template import chat_template_from_gguf, chat_template_from_hf, template_from_config
from realizar.models.config import ModelConfig, RopeScaling
from realizar.models.loader import load_model
from realizar.models.names import canonical_to_hf, expected_shapes, hf_to_canonical
from realizar.models.safetensors_loader import load_safetensors, read_safetensors_file


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("st")


@pytest.fixture(scope="module")
def models(workdir):
    return {arch: make_hf_model(arch, workdir, seed=i) for i, arch in enumerate(ARCHS)}


def _state(model) -> dict[str, np.ndarray]:
    return dict(model.tensors)  # float32 values of the saved (rounded) weights


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_f32(arch, models):
    d, hf = models[arch]
    m = load_model(d)
    assert m.format == "safetensors" and m.path == d
    c, hc = m.config, hf.config
    assert c.architecture == arch and c.rope_type == "neox"
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.intermediate_size) == (
        hc.vocab_size,
        hc.hidden_size,
        hc.num_hidden_layers,
        hc.intermediate_size,
    )
    assert (c.num_heads, c.num_kv_heads) == (hc.num_attention_heads, hc.num_key_value_heads)
    assert c.head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    if arch == "qwen3":
        assert c.head_dim != c.hidden_size // c.num_heads
    assert c.qkv_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert not c.tied_embeddings
    assert c.rms_norm_eps == hc.rms_norm_eps and c.rope_theta == 10000.0
    assert c.context_length == hc.max_position_embeddings
    assert (c.bos_token_id, c.eos_token_ids) == (BOS_ID, (EOS_ID,))
    assert m.tokenizer_json == d / "tokenizer.json"
    assert m.chat_template == CHAT_TEMPLATE
    assert m.metadata["model_type"] == arch
    sd = _state(hf)
    assert set(m.tensors) == {hf_to_canonical(k) for k in sd}
    for k, v in sd.items():
        t = m.tensors[hf_to_canonical(k)]
        assert t.ggml_type == T.F32 and t.shape == v.shape and not t.data.flags.writeable
        assert np.array_equal(t.dequantize(), v), k


@pytest.mark.parametrize("dtype,ggml", [("float16", T.F16), ("bfloat16", T.BF16)])
def test_half_precision(dtype, ggml, workdir):
    d, hf = make_hf_model("llama", workdir, seed=3, dtype=dtype)
    m = load_model(d)
    sd = _state(hf)  # float32 values of the saved (rounded) weights
    for k, v in sd.items():
        t = m.tensors[hf_to_canonical(k)]
        assert t.ggml_type == ggml and t.nbytes == v.size * 2
        assert np.array_equal(t.dequantize(), v), k


def test_bf16_bytes_are_raw(workdir):
    """bf16 goes through without NumPy support for it: raw bytes equal the saved bf16 bits."""
    d, hf = make_hf_model("qwen2", workdir, seed=4, dtype="bfloat16")
    m = load_model(d)
    want = bf16_bits(hf.tensors["model.layers.0.self_attn.q_proj.weight"]).view(np.uint8).reshape(-1)
    assert np.array_equal(m.tensors["blk.0.attn_q.weight"].data, want)


@pytest.mark.oracle
def test_factory_bf16_rounding_is_torchs():
    """The factory's float32 -> bf16 rounding (round to nearest even) is torch's."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 10,
                        np.array([np.inf, -np.inf, 0.0, -0.0, 1e-40, 3.4e38, 1.00390625, 1.01171875], np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_bits(x), want)


def test_sharded(workdir, models):
    d, hf = make_hf_model("qwen3", workdir, seed=2, name="qwen3-sharded", max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (d / "model.safetensors").exists()
    m = load_model(d)
    sd = _state(hf)
    assert set(m.tensors) == {hf_to_canonical(k) for k in sd}
    for k, v in sd.items():
        assert np.array_equal(m.tensors[hf_to_canonical(k)].dequantize(), v), k
    # also through the index file or one shard
    assert load_model(d / "model.safetensors.index.json").config == m.config
    some_shard = d / next(iter(index["weight_map"].values()))
    assert load_model(some_shard).config == m.config


def test_tied(workdir):
    d, hf = make_hf_model("llama", workdir, seed=6, name="tied", tie_word_embeddings=True)
    m = load_model(d)
    assert m.config.tied_embeddings and "output.weight" not in m.tensors


def test_tied_flag_with_lm_head_present(workdir, models):
    d = workdir / "tied-with-head"
    shutil.copytree(models["llama"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    m = load_model(d)
    assert m.config.tied_embeddings and "output.weight" not in m.tensors


def test_same_weights_as_gguf(workdir, models):
    """The F32 GGUF of a model holds the safetensors weights (llama Q/K permuted)."""
    for arch in ("llama", "qwen2"):
        d, _ = models[arch]
        st = load_model(d)
        gg = load_model(hf_to_gguf(d, workdir / f"{arch}.gguf", "F32"))
        assert {k for k in gg.tensors} == set(st.tensors)
        for name, t in st.tensors.items():
            a, b = t.dequantize(), gg.tensors[name].dequantize()
            if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = st.config.num_heads if "attn_q" in name else st.config.num_kv_heads
                b = unpermute_qk(b, heads)
            assert np.array_equal(a, b), name
        c1, c2 = st.config, gg.config
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "context_length", "qkv_bias", "qk_norm", "tied_embeddings"):
            assert getattr(c1, f) == getattr(c2, f), f


def test_names_roundtrip():
    cfg = ModelConfig("qwen2", 10, 8, 2, 2, 1, 4, 16, qkv_bias=True, qk_norm=True)
    for name in expected_shapes(cfg):
        assert hf_to_canonical(canonical_to_hf(name)) == name
    assert hf_to_canonical("model.layers.0.mlp.experts.0.weight") is None
    assert hf_to_canonical("model.rotary_emb.inv_freq") is None


def test_chat_template_sources(workdir, models):
    d = workdir / "templates"
    shutil.copytree(models["qwen2"][0], d)
    (d / "chat_template.jinja").write_text("JINJA {{ messages }}")
    assert load_model(d).chat_template == "JINJA {{ messages }}"
    (d / "chat_template.jinja").unlink()
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    assert load_model(d).chat_template == "D"
    (d / "tokenizer_config.json").unlink()
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert load_model(d).chat_template == "J"
    (d / "chat_template.json").unlink()
    (d / "tokenizer.json").unlink()
    m = load_model(d)
    assert m.chat_template is None and m.tokenizer_json is None


def test_chat_template_lookup(tmp_path):
    assert template_from_config("") is None and template_from_config(3) is None
    assert template_from_config([{"name": "tool_use", "template": "T"}]) == "T"
    assert chat_template_from_gguf({"tokenizer.chat_template": "G"}) == "G"
    assert chat_template_from_gguf({}) is None
    assert chat_template_from_hf(tmp_path, {"chat_template": "C"}) == "C"
    (tmp_path / "chat_template.jinja").write_text("F")
    assert chat_template_from_hf(tmp_path, {"chat_template": "C"}) == "F"  # the file wins
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ModelFormatError, match="tokenizer_config.json"):
        chat_template_from_hf(tmp_path)


def test_rope_settings(workdir, models):
    d = workdir / "rope"
    shutil.copytree(models["llama"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    c = load_model(d).config
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    # transformers 4.x layout
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 1e6
    (d / "config.json").write_text(json.dumps(cfg))
    c = load_model(d).config
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_model(d).config.rope_scaling == RopeScaling("linear", 2.0)


# ------------------------------------------------------------------------------ malformed input


@pytest.fixture
def copy_of(workdir, models, tmp_path):
    def make(arch="llama"):
        d = tmp_path / f"copy-{arch}"
        shutil.copytree(models[arch][0], d)
        return d

    return make


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_config(copy_of):
    d = copy_of()
    (d / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="no config.json"):
        load_model(d)


def test_unknown_architecture(copy_of):
    d = copy_of()
    _edit_config(d, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedError, match="gpt_neox"):
        load_model(d)


def test_architecture_from_class_name(copy_of):
    d = copy_of("qwen2")
    _edit_config(d, model_type=None)
    assert load_model(d).config.architecture == "qwen2"


def test_missing_config_key(copy_of):
    d = copy_of()
    _edit_config(d, num_hidden_layers=None)
    with pytest.raises(ModelFormatError, match="num_hidden_layers"):
        load_model(d)


def test_config_not_json(copy_of):
    d = copy_of()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="config.json"):
        load_model(d)


def test_missing_tensor(copy_of):
    d = copy_of()
    _edit_config(d, num_hidden_layers=3)
    with pytest.raises(ModelFormatError, match="missing tensor 'blk.2.attn_norm.weight'"):
        load_model(d)


def test_wrong_shape(copy_of):
    d = copy_of()
    _edit_config(d, intermediate_size=96)
    with pytest.raises(ModelFormatError, match=r"'blk.0.ffn_gate.weight' has shape \(128, 64\), expected \(96, 64\)"):
        load_model(d)


def _write_safetensors(path, tensors: dict[str, tuple[str, tuple, bytes]], header_extra=None):
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    header.update(header_extra or {})
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_unsupported_dtype(copy_of):
    d = copy_of()
    _write_safetensors(d / "extra.safetensors", {"model.layers.0.counter": ("I64", (2,), b"\0" * 16)})
    index = {"weight_map": {"model.layers.0.counter": "extra.safetensors"}}
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), framework="np") as f:
        for k in f.keys():
            index["weight_map"][k] = "model.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedError, match="'model.layers.0.counter' has dtype I64"):
        load_model(d)


def test_missing_shard(copy_of):
    d = copy_of()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(ModelFormatError, match="shard model-00002.safetensors is missing"):
        load_model(d)


def test_shard_escaping_directory(copy_of):
    d = copy_of()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../evil.safetensors"}}))
    with pytest.raises(ModelFormatError, match="leaves the model directory"):
        load_model(d)


def test_duplicate_tensor_across_shards(copy_of):
    d = copy_of()
    shutil.copy(d / "model.safetensors", d / "copy.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "copy.safetensors"}})
    )
    with pytest.raises(ModelFormatError, match="more than one shard"):
        load_model(d)


def test_no_weights(copy_of):
    d = copy_of()
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="no model.safetensors"):
        load_model(d)


@pytest.mark.parametrize("cut", [0, 4, 8, 9, 100, -1, -1000])
def test_truncated_safetensors(copy_of, cut):
    d = copy_of()
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    with pytest.raises(ModelFormatError):
        load_model(d)


@pytest.mark.parametrize(
    "header,match",
    [
        (struct.pack("<Q", 2**62), "header length"),
        (struct.pack("<Q", 5) + b"[1,2]", "not a JSON object"),
        (struct.pack("<Q", 3) + b"\xff\xfe{", "not valid JSON"),
    ],
)
def test_bad_headers(tmp_path, header, match):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(header + b"\0" * 16)
    with pytest.raises(ModelFormatError, match=match):
        read_safetensors_file(p)


@pytest.mark.parametrize(
    "entry,match",
    [
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, "inconsistent"),
        ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}, "inconsistent"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 2**60]}, "inconsistent"),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "negative"),
        ({"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}, "unknown dtype"),
        ({"dtype": "F32", "shape": "abc", "data_offsets": [0, 16]}, "bad header entry"),
        ({"dtype": "F32"}, "bad header entry"),
    ],
)
def test_bad_entries(tmp_path, entry, match):
    h = json.dumps({"w": entry}).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 16)
    with pytest.raises(ModelFormatError, match=match):
        read_safetensors_file(p)


@pytest.mark.parametrize(
    "second,match",
    [
        ((4, 12), "invalid offset"),  # overlaps the first tensor
        ((12, 20), "invalid offset"),  # leaves a gap after it
    ],
)
def test_overlapping_or_gapped_offsets(tmp_path, second, match):
    h = json.dumps({
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": list(second)},
    }).encode()  # fmt: skip
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * second[1])
    with pytest.raises(ModelFormatError, match=f"bad.safetensors: .*{match}"):
        read_safetensors_file(p)


def test_trailing_bytes(tmp_path):
    p = tmp_path / "trail.safetensors"
    _write_safetensors(p, {"w": ("F32", (2,), b"\0" * 8)})
    p.write_bytes(p.read_bytes() + b"\0" * 4)
    with pytest.raises(ModelFormatError, match="trail.safetensors"):
        read_safetensors_file(p)


def test_read_safetensors_file_metadata(tmp_path):
    p = tmp_path / "ok.safetensors"
    x = np.arange(6, dtype=np.float32)
    _write_safetensors(p, {"w": ("F32", (2, 3), x.tobytes())}, {"__metadata__": {"format": "pt"}})
    tensors, meta = read_safetensors_file(p)
    assert meta == {"format": "pt"}
    assert np.array_equal(tensors["w"].dequantize(), x.reshape(2, 3))


def test_load_safetensors_direct(models):
    d, _ = models["mistral"]
    m = load_safetensors(d)
    assert m.config.architecture == "mistral"


def test_single_safetensors_file_path(copy_of):
    """``--model dir/x.safetensors`` loads that file's tensors (other files beside it are ignored),
    and errors name the file."""
    d = copy_of("llama")
    whole = load_model(d)
    (d / "model.safetensors").rename(d / "x.safetensors")
    (d / "y.safetensors").write_bytes((d / "x.safetensors").read_bytes()[:100])  # a broken neighbour
    m = load_model(d / "x.safetensors")
    assert set(m.tensors) == set(whole.tensors)
    for k, t in whole.tensors.items():
        assert np.array_equal(m.tensors[k].dequantize(), t.dequantize()), k
    with pytest.raises(ModelFormatError, match="y.safetensors"):
        load_model(d / "y.safetensors")
    with pytest.raises(ModelFormatError, match="y.safetensors"):
        load_model(d)  # the directory reads every *.safetensors file
    (d / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"x\.safetensors: no config.json"):
        load_model(d / "x.safetensors")
