"""The catalog page (reference/catalog.md): every field of a catalog file,
from the pydantic models of ``llmgw/catalog.py`` and ``llmgw/types``.
"""

import inspect

from refgen.common import doc_of, model_table, models_closure
from refgen.meanings import field_meaning


def _literal_block(doc: str) -> str:
    """The reST literal block (after ``::``) of a docstring."""
    text = inspect.cleandoc(doc)
    block = text.split("::", 1)[1] if "::" in text else ""
    return inspect.cleandoc(block.split("\n\n", 2)[1] if block.count("\n\n") >= 1 else block)


def catalog_page() -> str:
    from llmgw import catalog  # noqa: PLC0415

    parts = [
        "# Catalog fields\n\n",
        "Every field of a catalog file (`llmgw model apply FILE`, `PUT /admin/models/{name}`), "
        "read from the pydantic models in `llmgw/catalog.py` and `llmgw/types/`. "
        "Unknown fields are errors, and every error names its field. "
        "How to use them: [Models and the catalog](../guides/models.md).\n\n",
        f"```yaml\n{_literal_block(catalog.__doc__ or '')}\n```\n\n",
    ]
    for model in models_closure([catalog.CatalogFile]):
        parts.append(f"## {model.__name__}\n\n{doc_of(model)}\n\n")
        parts.append(model_table(model, field_meaning(model)) + "\n")
    return "".join(parts)
