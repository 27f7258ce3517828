"""`python -m megaframe.plan [--json] [--dry-run=RANK] [OVERRIDE ...]`: the same as `megaframe-plan`."""
from megaframe.plan.cli import main

if __name__ == "__main__":
    main()
