"""Running the verifier fast: per-sequence KV slots (``slots``), CUDA graphs (``graphs``), batched and
batch-1 decoders (``generate``), speculative decoding of one prompt (``speculative``), hidden-state extraction
(``extractor``), and answers from an OpenAI-compatible server (``remote``)."""
