"""NPU Studio: a Hugging Face causal LLM to a phone NPU under Qualcomm Genie."""
__version__ = "0.1.0"
