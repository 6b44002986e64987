"""Measuring a draft: speculative decoding over a prompt set (``measure``) and the tau its training accuracy
predicts (``offline``)."""
