"""Training the draft: mixed precision (``precision``), the loss and the metrics that predict tau
(``loss``), the optimizer step (``optim``), training batches (``batches``), what training reports (``log``), and
the loop (``trainer``)."""
