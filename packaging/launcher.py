"""Entry script of the frozen app: `NPU Studio` with no arguments opens the window, with arguments it is the CLI."""

import multiprocessing

from npustudio.cli import main

if __name__ == "__main__":
    # the stages the window starts run in spawned children (core/isolated.py): in a frozen app each child is
    # this executable again, and freeze_support() turns it into the child instead of a second window
    multiprocessing.freeze_support()
    raise SystemExit(main())
