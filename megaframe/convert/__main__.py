"""`python -m megaframe.convert {to-hf,from-hf} ...`: the same as `megaframe-convert`."""
from megaframe.convert.console import main

if __name__ == "__main__":
    main()
