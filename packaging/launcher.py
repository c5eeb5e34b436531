"""Entry script of the frozen app: `NPU Studio` with no arguments opens the window, with arguments it is the CLI."""

import multiprocessing
import runpy
import sys

if __name__ == "__main__":
    # the stages the window starts run in spawned children (core/isolated.py): in a frozen app each child is
    # this executable again, and freeze_support() turns it into the child instead of a second window
    multiprocessing.freeze_support()
    if len(sys.argv) > 2 and sys.argv[1] == "-m":
        # `python -m MODULE ARGS` as the pipeline starts its helper processes (core/forked.py: the compile of each
        # graph, the simulator check; the virtual device's genie-t2t-run): here this executable is the interpreter
        module = sys.argv[2]
        sys.argv = [sys.argv[0], *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        raise SystemExit(0)
    from npustudio.cli import main

    raise SystemExit(main())
