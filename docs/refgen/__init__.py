"""The reference pages' generators, one module a page (docs/gen_ref.py runs them).

Not a package of llmgw: mkdocs-gen-files runs docs/gen_ref.py, which puts
docs/ on ``sys.path`` to import this; nothing in the project imports it.
"""
