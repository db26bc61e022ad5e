"""``realizar info``: architecture, shapes, tensors and tokenizer of a model file."""

from __future__ import annotations

import argparse
import json
from typing import Any

from realizar.cli.common import human_bytes, human_count


def _type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        return f"type{ggml_type}"


def model_info(path: str) -> dict:
    """Everything ``realizar info`` reports, as plain data."""
    from realizar.engine import load_tokenizer
    from realizar.models.loader import load_model

    loaded = load_model(path)
    c = loaded.config
    by_type: dict[str, dict] = {}
    params = 0
    total = 0
    tensors = []
    for name, t in loaded.tensors.items():
        n = 1
        for d in t.shape:
            n *= int(d)
        params += n
        total += t.nbytes
        tname = _type_name(t.ggml_type)
        entry = by_type.setdefault(tname, {"count": 0, "bytes": 0, "parameters": 0})
        entry["count"] += 1
        entry["bytes"] += t.nbytes
        entry["parameters"] += n
        tensors.append({"name": name, "type": tname, "shape": list(t.shape), "bytes": t.nbytes})
    tok_info: dict[str, Any] = {}
    try:
        tok = load_tokenizer(loaded)
        tok_info = {
            "kind": getattr(tok, "kind", None),
            "vocab_size": getattr(tok, "vocab_size", None),
            "bos_token_id": getattr(tok, "bos_token_id", None),
            "eos_token_ids": list(getattr(tok, "eos_token_ids", ()) or ()),
            "add_bos": getattr(tok, "add_bos", None),
            "chat_template": bool(getattr(tok, "chat_template", None)),
        }
    except Exception as e:  # noqa: BLE001 - info still shows the rest
        tok_info = {"error": f"{type(e).__name__}: {e}"}
    md = loaded.metadata if loaded.format == "gguf" else {}
    if loaded.format == "gguf":
        tok_info["model"] = md.get("tokenizer.ggml.model")
        tok_info["pre"] = md.get("tokenizer.ggml.pre")
    file_bytes = (
        loaded.path.stat().st_size
        if loaded.path.is_file()
        else sum(p.stat().st_size for p in loaded.path.glob("*.safetensors"))
    )
    return {
        "path": str(loaded.path),
        "format": loaded.format,
        "name": md.get("general.name") if md else None,
        "file_bytes": file_bytes,
        "architecture": c.architecture,
        "context_length": c.context_length,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rope_type": c.rope_type,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "tied_embeddings": c.tied_embeddings,
        "qkv_bias": c.qkv_bias,
        "qk_norm": c.qk_norm,
        "experts": ({"count": c.num_experts, "used": c.num_experts_used, "ffn_size": c.expert_ffn_size,
                     "weights_norm": c.expert_weights_norm} if c.is_moe else None),
        "parameters": params,
        "active_parameters": params - (c.parameter_counts()[0] - c.parameter_counts()[1]),
        "tensor_bytes": total,
        "tensor_count": len(tensors),
        "tensor_types": by_type,
        "tokenizer": tok_info,
        "tensors": tensors,
    }


def cmd_info(args: argparse.Namespace) -> int:
    from realizar.models.hub import resolve_model

    path = resolve_model(args.model)  # the default model, a path, or a Hub id (downloaded once and cached)
    info = model_info(str(path))
    if args.json:
        if not args.tensors:
            info.pop("tensors")
        print(json.dumps(info, indent=2))
        return 0
    c = info
    rows = [
        ("file", f"{c['path']} ({human_bytes(c['file_bytes'])}, {c['format']})"),
        ("name", c["name"] or "-"),
        ("architecture", c["architecture"]),
        ("parameters", f"{human_count(c['parameters'])} ({c['parameters']:,})"
                       + (f", {human_count(c['active_parameters'])} active a token" if c["experts"] else "")),
        ("context length", f"{c['context_length']:,}"),
        ("layers", c["num_layers"]),
        ("hidden size", c["hidden_size"]),
        ("attention", f"{c['num_heads']} heads, {c['num_kv_heads']} KV heads, head_dim {c['head_dim']}"
                      + (", qkv bias" if c["qkv_bias"] else "") + (", q/k norm" if c["qk_norm"] else "")),
        ("feed-forward", f"{c['intermediate_size']} (SwiGLU)" if not c["experts"] else
                         f"{c['experts']['count']} experts of {c['experts']['ffn_size']} (SwiGLU), "
                         f"{c['experts']['used']} a token"),
        ("vocabulary", f"{c['vocab_size']:,}"),
        ("rope", f"{c['rope_type']}, theta {c['rope_theta']:g}"),
        ("rms norm eps", f"{c['rms_norm_eps']:.3g}"),
        ("tied embeddings", "yes" if c["tied_embeddings"] else "no"),
        ("tensors", f"{c['tensor_count']} ({human_bytes(c['tensor_bytes'])})"),
    ]
    for tname, e in sorted(c["tensor_types"].items(), key=lambda kv: -kv[1]["bytes"]):
        n = e["count"]
        rows.append((f"  {tname}", f"{n} tensor{'' if n == 1 else 's'}, {human_count(e['parameters'])} params, "
                                   f"{human_bytes(e['bytes'])}"))
    t = c["tokenizer"]
    if "error" in t:
        rows.append(("tokenizer", f"unavailable: {t['error']}"))
    else:
        kind = t.get("model") or t.get("kind")
        desc = f"{kind}" + (f" (pre-tokenizer {t['pre']})" if t.get("pre") else "")
        desc += f", {t.get('vocab_size'):,} tokens" if t.get("vocab_size") else ""
        rows.append(("tokenizer", desc))
        rows.append(("  special", f"bos {t.get('bos_token_id')}, eos {t.get('eos_token_ids')}, "
                                  f"adds bos: {'yes' if t.get('add_bos') else 'no'}"))
        rows.append(("  chat template", "yes" if t.get("chat_template") else "no"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.tensors:
        print()
        nw = max((len(x["name"]) for x in c["tensors"]), default=4)
        print(f"{'tensor':<{nw}}  {'type':<6}  {'shape':<16}  bytes")
        for x in c["tensors"]:
            shape = "x".join(str(d) for d in x["shape"])
            print(f"{x['name']:<{nw}}  {x['type']:<6}  {shape:<16}  {x['bytes']:,}")
    return 0


def register(command) -> None:
    """Add the subcommand's parser; ``command(name, help, description)`` makes one."""
    p = command("info", "describe a model file: architecture, shapes, tensors, tokenizer",
                "Describe MODEL (a GGUF file, a safetensors directory or a Hub id org/name[:QUANT]; default: the "
                "default model) without loading its weights.")
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="GGUF file, HF safetensors directory or Hub id org/name[:QUANT] "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--tensors", action="store_true", help="also list every tensor (name, type, shape, bytes)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)
