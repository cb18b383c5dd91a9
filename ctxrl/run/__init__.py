"""A run, from its config to its end: the checks every command runs before it loads anything.

``validate`` (every check of a config on its own: values, choices and the registered names they pick, how the
settings combine; ``ctxrl.config.from_dict`` runs it once), ``components`` (the tables of registered components'
own settings: which class reads ``[algo.NAME]``, ``[context.NAME]``, ``[env.NAME]``), ``preflight`` (what a command
checks before it builds, converts, downloads or loads a model: the environment, its splits, files, packages, the
models named, and what only the tokenizer can tell).

Importing this package imports none of them: ``ctxrl.config`` reaches them lazily, and ``ctxrl --help`` stays
light.
"""
