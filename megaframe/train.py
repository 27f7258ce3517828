"""`python -m megaframe.train [OVERRIDE ...]`: the same as `megaframe-train`."""
from megaframe.cli import train_main

if __name__ == "__main__":
    train_main()
