"""The one-command local deployment: ``python -m prfaas_sglang.demo``."""
