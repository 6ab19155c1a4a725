"""Custom resources checked against the vendored CRDs' OpenAPI schemas (tests/deploy/schemas).

An API server validates a custom resource against the `openAPIV3Schema` of the CRD version its
apiVersion names; `kubectl apply` asks it to refuse fields the schema does not declare (field
validation Strict). The same is done here without a cluster: the schema, made strict (every
object schema that lists its properties and neither allows others nor preserves unknown fields
refuses undeclared ones), is handed to jsonschema. CEL rules (x-kubernetes-validations) and
defaulting are an API server's and are not reproduced.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).resolve().parents[1] / "deploy" / "schemas"

Object = dict[str, Any]


@cache
def crd_schemas() -> dict[tuple[str, str], Object]:
    """The strict schema of every served version of every vendored CRD, by (apiVersion, kind)."""
    found: dict[tuple[str, str], Object] = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert crd["kind"] == "CustomResourceDefinition", path
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served", False):
                schema = strict(version["schema"]["openAPIV3Schema"])
                found[(f"{group}/{version['name']}", kind)] = schema
    return found


def strict(schema: Object) -> Object:
    """`schema` with undeclared fields refused wherever an API server prunes or refuses them."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields", False)
            ):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


def validate_custom_resource(document: Object) -> None:
    """Raise jsonschema.ValidationError unless `document` satisfies its CRD's schema."""
    key = (document["apiVersion"], document["kind"])
    schema = crd_schemas().get(key)
    if schema is None:
        raise AssertionError(f"no vendored CRD schema for {key[1]} ({key[0]}) in {SCHEMAS}")
    # OpenAPI 3.0 schemas are draft 4's keywords (a boolean exclusiveMinimum, no const).
    jsonschema.Draft4Validator(schema).validate(document)
