"""The ground under ``core/`` and ``fp8/``: argument and state-key checks both use (pure Python and torch)."""
