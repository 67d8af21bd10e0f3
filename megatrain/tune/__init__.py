"""Schedule search by simulation: `--schedule auto` and its budget rule (auto.py), and the GPU share of the optimizer
(search.py `best_gpu_fraction`)."""
