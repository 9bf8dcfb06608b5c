"""Writes the reference pages from the code, at every ``mkdocs build``.

Run by the mkdocs-gen-files plugin (mkdocs.yml). It imports llmgw and reads
its source; it starts nothing (no server, Temporal or engine), so the docs
build anywhere in seconds. What it reads:

- the catalog: the pydantic models of ``llmgw/catalog.py`` and ``llmgw/types``;
- settings: every ``BaseSettings`` class in the packages (found in the
  source), and ``LLMGW_*`` names read outside them;
- the CLI: the typer app of ``llmgw_cli/app.py``;
- the HTTP API: the router app's OpenAPI document (the app is built, not served);
- metrics: every Prometheus metric and Temporal meter declared in the source;
- Temporal: the workflow classes of ``workflows/`` and their signals,
  updates and queries, with example inputs.

A name, type, default or description changed in the code changes the page.
"""

import json
import sys
from pathlib import Path

import mkdocs_gen_files

# The pages' generators (docs/refgen/, one module a page) and the packages they read.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from refgen.catalog import catalog_page
from refgen.cli import cli_page
from refgen.common import write_page
from refgen.http import http_page, openapi_spec
from refgen.metrics import metrics_page
from refgen.settings import settings_page
from refgen.temporal import temporal_page


def main() -> None:
    spec = openapi_spec()
    write_page("reference/catalog.md", catalog_page())
    write_page("reference/settings.md", settings_page())
    write_page("reference/cli.md", cli_page())
    write_page("reference/http-api.md", http_page(spec))
    with mkdocs_gen_files.open("reference/openapi.json", "w") as out:
        json.dump(spec, out, indent=1)
    write_page("reference/metrics.md", metrics_page())
    write_page("reference/temporal.md", temporal_page())


main()
