"""Write tests/data/k8s-schemas.json: the JSON schemas tests/unit/test_deploy.py validates deploy/k8s against.

Why vendored: the tests run offline. Kept small: only the definitions reachable from the kinds
deploy/k8s uses, descriptions stripped. Sources (both Apache-2.0, tests/data/k8s-schemas.LICENSE):
  * Kubernetes API (Deployment, ConfigMap, Secret): the "local-strict" JSON schemas generated from
    the Kubernetes OpenAPI spec, as shipped by the PyPI package kubernetes-validate
    (kubernetes_validate/kubernetes-json-schema/v<VERSION>-local-strict/_definitions.json)
  * KEDA (ScaledObject, TriggerAuthentication): openAPIV3Schema of config/crd/bases/keda.sh_*.yaml
    in github.com/kedacore/keda, made strict here (unknown fields are errors, as kubeconform -strict)

    python scripts/vendor_k8s_schemas.py DEFINITIONS_JSON KEDA_CRD_DIR K8S_VERSION KEDA_VERSION
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

K8S_ROOTS = {
    "apps/v1/Deployment": "io.k8s.api.apps.v1.Deployment",
    "v1/ConfigMap": "io.k8s.api.core.v1.ConfigMap",
    "v1/Secret": "io.k8s.api.core.v1.Secret",
}
KEDA_CRDS = {
    "keda.sh/v1alpha1/ScaledObject": "keda.sh_scaledobjects.yaml",
    "keda.sh/v1alpha1/TriggerAuthentication": "keda.sh_triggerauthentications.yaml",
}
DROP = {"description", "x-kubernetes-group-version-kind"}


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k not in DROP}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def strict(node):
    """Objects that list their properties reject others (a misspelt field is an error, not pruned)."""
    if isinstance(node, dict):
        node = {k: strict(v) for k, v in node.items()}
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


def refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v.rsplit("/", 1)[-1]
            else:
                yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def main(definitions: str, keda_crds: str, k8s_version: str, keda_version: str) -> None:
    defs = json.loads(Path(definitions).read_text())["$defs"]
    keep, todo = set(), list(K8S_ROOTS.values())
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo.extend(refs(defs[name]))
    out = {name: strip(defs[name]) for name in sorted(keep)}
    for kind, file in KEDA_CRDS.items():
        crd = yaml.safe_load((Path(keda_crds) / file).read_text())
        [version] = [v for v in crd["spec"]["versions"] if v["name"] == kind.split("/")[1]]
        out[kind] = strict(strip(version["schema"]["openAPIV3Schema"]))
    doc = {
        "$comment": f"Kubernetes {k8s_version} (local-strict, from kubernetes-validate) and KEDA {keda_version} CRDs; "
        "Apache-2.0; written by scripts/vendor_k8s_schemas.py",
        "kinds": {**K8S_ROOTS, **{k: k for k in KEDA_CRDS}},
        "$defs": out,
    }
    target = Path(__file__).resolve().parent.parent / "tests" / "data" / "k8s-schemas.json"
    lines = ["{", f' "$comment": {json.dumps(doc["$comment"])},', f' "kinds": {json.dumps(doc["kinds"])},']
    lines.append(' "$defs": {')
    lines += [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True, separators=(',', ':'))}," for k, v in out.items()]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" }", "}"]
    target.write_text("\n".join(lines) + "\n")
    print(f"{target}: {len(out)} definitions, {target.stat().st_size} bytes")


if __name__ == "__main__":
    main(*sys.argv[1:5])
