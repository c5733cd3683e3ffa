"""Step transforms, one per file, each usable on its own; `make_train_step` composes them.

`amp`, `recompute`, `gradient_merge`, `grad_allreduce` and `pipeline`.
"""
