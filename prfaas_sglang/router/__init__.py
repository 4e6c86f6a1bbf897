"""The global scheduler: ``policy`` (where a request goes), ``threshold`` (how ``t`` moves),
``link``, ``workers``, ``service`` and ``metrics`` are pure; ``server`` is the HTTP front end
and ``__main__`` its entry point (``python -m prfaas_sglang.router``)."""
