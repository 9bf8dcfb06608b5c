"""The HTTP API page (reference/http-api.md) and its openapi.json: the router
app's OpenAPI document (the app is built, not served).
"""

import tempfile
from typing import Any

from refgen.common import cell


class _NoReplicas:
    """A replica source with nothing in it: the app is built, never served."""

    async def replicas(self) -> list[Any]:
        return []


def openapi_spec() -> dict[str, Any]:
    from llmgw.store import Store  # noqa: PLC0415
    from router.app import create_app  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/docs.db")
        store.migrate()
        try:
            app = create_app(store, _NoReplicas())
            return app.openapi()
        finally:
            store.close()


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    if "anyOf" in schema:
        return " | ".join(_schema_name(s) for s in schema["anyOf"])
    return str(schema.get("type", schema.get("title", "object")))


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    out = [f"### {method.upper()} {path}\n\n"]
    if op.get("summary"):
        out.append(f"**{op['summary']}.** ")
    out.append((op.get("description") or "").strip() + "\n\n")
    params = op.get("parameters", [])
    if params:
        out.append("| parameter | in | type | required | meaning |\n|---|---|---|---|---|\n")
        for p in params:
            out.append(
                f"| `{p['name']}` | {p['in']} | {cell(_schema_name(p.get('schema', {})))} "
                f"| {'yes' if p.get('required') else 'no'} | {cell(p.get('description', ''))} |\n"
            )
        out.append("\n")
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
    if body:
        schema = body.get("schema", {})
        title = schema.get("title") if "$ref" not in schema else None
        out.append(f"Body: {title or _schema_name(schema)}.\n\n")
        if "properties" in schema:
            out.append(_properties(schema))
    out.append("| status | meaning |\n|---|---|\n")
    for status, answer in op.get("responses", {}).items():
        schema = answer.get("content", {}).get("application/json", {}).get("schema", {})
        body = f": {_schema_name(schema)}" if "$ref" in schema or "items" in schema else ""
        out.append(f"| {status} | {cell(answer.get('description', '') + body)} |\n")
    return "".join(out) + "\n"


def _properties(schema: dict[str, Any]) -> str:
    required = set(schema.get("required", []))
    out = ["| field | type | required | meaning |\n|---|---|---|---|\n"]
    for field, sub in schema["properties"].items():
        out.append(
            f"| `{field}` | {cell(_schema_name(sub))} | {'yes' if field in required else 'no'} "
            f"| {cell(sub.get('description', ''))} |\n"
        )
    return "".join(out) + "\n"


def _schemas_section(components: dict[str, Any]) -> str:
    out = ["## Schemas\n\n"]
    for name, schema in sorted(components.items()):
        out.append(f"### {name}\n\n{(schema.get('description') or '').strip()}\n\n")
        if schema.get("properties"):
            out.append(_properties(schema))
        elif "enum" in schema:
            out.append("One of " + ", ".join(f"`{v}`" for v in schema["enum"]) + ".\n\n")
    return "".join(out)


def http_page(spec: dict[str, Any]) -> str:
    parts = [
        "# HTTP API\n\n",
        "The router's OpenAPI document, rendered at build time from the app itself "
        "(`router/app.py`; the router serves the same at `/openapi.json` and `/docs`). "
        "The raw document: [openapi.json](openapi.json). "
        "Clients call `/v1` with a client key; `/admin` needs an admin credential "
        "([Keys, quotas and usage](../guides/keys-quotas-usage.md)). `GET /metrics` and "
        "`GET /healthz` are left out of the document: see [Metrics](metrics.md).\n\n",
    ]
    groups = {"/v1": "## OpenAI API (/v1)\n\n", "/admin": "## Admin API (/admin)\n\n"}
    for prefix, title in groups.items():
        parts.append(title)
        for path, ops in spec["paths"].items():
            if path.startswith(prefix):
                parts.extend(_operation(path, m, op) for m, op in ops.items())
    rest = [p for p in spec["paths"] if not p.startswith(tuple(groups))]
    if rest:
        parts.append("## Other\n\n")
        for path in rest:
            parts.extend(_operation(path, m, op) for m, op in spec["paths"][path].items())
    parts.append(_schemas_section(spec.get("components", {}).get("schemas", {})))
    return "".join(parts)
