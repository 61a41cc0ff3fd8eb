"""pallax usage examples: complete user code, tested in CI (tests/test_custom_op.py)."""
