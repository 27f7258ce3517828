"""`megaframe-train` and `python -m megaframe.train [OVERRIDE ...]`: megaframe.launch.main.train_main, with
the garbage collector paused until start-up ends (megaframe/common/startup.py)."""
from megaframe.common.startup import pause_collector
from megaframe.common.startup_signals import announce_stops_during_startup
from megaframe.launch.guard import remember_parent


def main() -> None:
    remember_parent()  # before any import that takes time (launch/guard.py)
    announce_stops_during_startup()  # a SIGTERM in the 2 s of imports ended the process without a word
    pause_collector()  # before megaframe.launch imports torch
    from megaframe.launch.main import train_main

    train_main()


if __name__ == "__main__":
    main()
