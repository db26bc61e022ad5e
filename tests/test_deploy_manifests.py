"""The Kubernetes manifests under deploy/: every document validates against the Kubernetes API schemas
(kubernetes-validate, strict: no unknown fields), and the commands they run are ones realizar's and
sglang-router's own argument parsers accept, so the manifests cannot drift from the CLIs."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
K8S_VERSION = "1.35.0"
DOCS = [(p.name, i, d) for p in sorted(DEPLOY.glob("*.yaml")) for i, d in enumerate(yaml.safe_load_all(p.read_text()))
        if d is not None]


def test_there_are_manifests():
    kinds = {d["kind"] for _, _, d in DOCS}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "Role", "RoleBinding", "ServiceAccount"} <= kinds


@pytest.mark.parametrize("name,index,doc", DOCS, ids=[f"{n}#{i}-{d['kind']}" for n, i, d in DOCS])
def test_manifest_validates_against_the_kubernetes_schema(name, index, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _containers(name: str) -> list[dict]:
    return [c for n, _, d in DOCS if d["kind"] == "Deployment" and d["metadata"]["name"] == name
            for c in d["spec"]["template"]["spec"]["containers"]]


def test_the_serve_command_is_one_the_cli_accepts():
    from realizar.cli import build_parser

    (c,) = _containers("realizar")
    args = build_parser().parse_args(c["args"])
    assert args.func.__name__ == "cmd_serve" and args.host == "0.0.0.0" and args.port == 8000
    probe = c["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"


def test_the_router_command_is_one_sglang_router_accepts():
    pytest.importorskip("sglang_router")
    from sglang_router.launch_router import parse_router_args

    (c,) = _containers("realizar-router")
    assert c["command"][-2:] == ["-m", "sglang_router.launch_router"]
    args = parse_router_args(c["args"])
    assert args.policy == "cache_aware" and args.service_discovery


def test_the_validation_catches_a_wrong_manifest():
    """The same check refuses an unknown field and a wrong type (it is not a check that always passes)."""
    import copy

    dep = next(d for _, _, d in DOCS if d["kind"] == "Deployment")
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # (a typo)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
