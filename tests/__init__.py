"""megaframe's test suite (tests/support holds what the tests share)."""
