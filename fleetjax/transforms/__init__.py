"""Step transforms, one concept per module (the pipeline a package of its parts), each usable on
its own; `fleetjax._chain` composes them for `make_train_step`.

`amp`, `recompute`, `gradient_merge`, `grad_allreduce` and `pipeline`.
"""
