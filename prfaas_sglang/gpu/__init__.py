"""Real SGLang on a lent GPU machine: the carry bundle, the tiny hybrid model, the end-to-end check.

``bundle`` (pure: what goes in, what is dropped, how a bundle is verified), ``wheels`` (reading
wheels from PyPI or a local wheelhouse), ``trace`` (what the SGLang server imports, run in a
subprocess), ``builder`` (``bench gpu-bundle``), ``model`` (the tiny hybrid model) and ``e2e``
(``bench gpu-e2e``).
"""
