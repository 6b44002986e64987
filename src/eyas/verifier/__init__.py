"""The verifier: what a checkpoint holds without loading it (``locate``, ``info``: ``resolve`` gives a
``VerifierInfo``), loading and running its parts (``load``: head tensors, the text backbone, the tokenizer), and
compressed-tensors int4 weights kept packed (``packed``). Imports only ``eyas.core``."""
