"""Qt-free pipeline: every stage is one module with one entry point."""
