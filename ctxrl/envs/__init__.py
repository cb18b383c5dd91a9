"""Environments: the ``Env`` protocol, the registry, ``check_env``, and built-in environments.

Built-in environments are named here and imported lazily by the registry (``get_env_class``), so importing
this package stays cheap; they import the registry's module to register, so that module does not name them.
The families of environments other packages provide (``reasoning_gym:TASK``, ``verifiers:ID``) are named here too,
by prefix (``add_scheme``); their adapters import those packages only when a name of theirs is resolved.
"""

from ctxrl.envs.base import Env, EnvError
from ctxrl.envs.check import CheckEnvError, assert_env_ok, check_env
from ctxrl.envs.registry import ENVIRONMENTS, add_scheme, get_env_class, list_envs, register

ENVIRONMENTS.add_builtins(
    "ctxrl.envs.calculator", "ctxrl.envs.kv_chain", "ctxrl.envs.fact_hunt", "ctxrl.envs.search_join",
    "ctxrl.envs.bandit", "ctxrl.envs.python_math", "ctxrl.envs.search_qa", "ctxrl.envs.sokoban",
    "ctxrl.envs.minesweeper",
    "ctxrl.envs.codebreak", "ctxrl.envs.hidden_word", "ctxrl.envs.jsonl_tools", "ctxrl.envs.harness",
    "ctxrl.envs.kuhn_poker", "ctxrl.envs.propose_solve", "ctxrl.envs.repo_tasks")
add_scheme("reasoning_gym", "ctxrl.envs.from_reasoning_gym")
add_scheme("verifiers", "ctxrl.envs.from_verifiers")
add_scheme("openenv", "ctxrl.envs.from_openenv")
add_scheme("nemo_gym", "ctxrl.envs.from_nemo_gym")

__all__ = ["CheckEnvError", "Env", "EnvError", "assert_env_ok", "check_env", "get_env_class", "list_envs", "register"]
