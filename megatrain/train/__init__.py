"""A training run: config, the loop, run directory, metrics and logs, eval, resume, export, auto re-checks."""
