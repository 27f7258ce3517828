"""The leaves every floor of megaframe uses: atomic writes, safe file opening, the run-dir lock,
failures and their exit codes, paths to conf/ and recipes/, the start-up collector pause, the
launcher's variables, the eager islands in compiled blocks, Ctrl-C's one line. They import nothing
of megaframe outside this package (tests/unit/test_architecture.py)."""
