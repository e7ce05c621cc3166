"""Helpers shared by the test modules; no test module imports another
(tests/test_test_layout.py checks it)."""
