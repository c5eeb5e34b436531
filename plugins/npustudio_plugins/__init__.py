"""Model-family recipes shipped with NPU Studio, registered as `npustudio.families` entry points."""
