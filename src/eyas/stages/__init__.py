"""One module per pipeline stage, each a typed config plus ``run(config)``: ``prepare``, ``regenerate``,
``vocab``, ``extract``, ``train``, ``evaluate`` (``eyas eval``), ``export``, ``plan``. Stages meet only through
files on disk: no stage imports another."""
