"""`megaframe-train` and `python -m megaframe.train [OVERRIDE ...]`: megaframe.launch.main.train_main, with
the garbage collector paused until start-up ends (megaframe/common/startup.py)."""
from megaframe.common.startup import pause_collector
from megaframe.launch.guard import remember_parent


def main() -> None:
    remember_parent()  # before any import that takes time (launch/guard.py)
    pause_collector()  # before megaframe.launch imports torch
    from megaframe.launch.main import train_main

    train_main()


if __name__ == "__main__":
    main()
