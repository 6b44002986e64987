"""eyas: train EAGLE-3 speculative-decoding drafts for any Hugging Face verifier.

Stages meet only through files on disk and their ``manifest.json``; each stage
is one module, one CLI subcommand and one Python function with the same
keyword arguments.
"""

__version__ = "0.1.0"
