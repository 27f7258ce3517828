"""`python -m megaframe.plan [--json] [OVERRIDE ...]`: the same as `megaframe-plan`."""
from megaframe.plan.cli import main

if __name__ == "__main__":
    main()
