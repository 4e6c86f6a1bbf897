"""The documentation site (``docs/``, MkDocs): its reference pages generated from the code, its build.

``python -m prfaas_sglang.docsite write`` regenerates ``docs/reference/*.md`` (:mod:`.reference`);
``check`` fails naming every stale page; ``build`` checks, then runs ``mkdocs build --strict``
(``make docs``). Nothing in a reference page is written by hand: a test fails when one is stale.
"""

PURE_MODULES = ("figures",)  # the rest read the checkout (pages, the Makefile) or run MkDocs
