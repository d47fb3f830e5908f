"""Pretrained models from a local Hugging Face directory: the safetensors format, the byte-level
BPE tokenizer, the Llama family's model, and loading and exporting them, written here with
torch only (nothing is downloaded or imported from Hugging Face's libraries)."""


class PretrainedError(ValueError):
    """A model directory or file that cannot be used: one line naming the file and the fix."""
