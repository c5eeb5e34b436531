"""Entry script of the frozen app: `NPU Studio` with no arguments opens the window, with arguments it is the CLI."""

from npustudio.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
