"""Pure tensor functions of the RL math: advantage estimators, KL estimators, policy and value
losses, loss aggregation, log-probs and sampling. No I/O, no globals, keyword-only arguments,
one signature per registry; shapes in the docstrings ([B, T] = sequences × response tokens)."""
