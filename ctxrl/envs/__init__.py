"""Environments: the ``Env`` protocol, the registry, ``check_env``, and built-in environments.

Built-in environments are imported lazily by the registry (``get_env_class``), so importing
this package stays cheap.
"""

from ctxrl.envs.base import Env, EnvError
from ctxrl.envs.check import CheckEnvError, assert_env_ok, check_env
from ctxrl.envs.registry import get_env_class, list_envs, register

__all__ = ["CheckEnvError", "Env", "EnvError", "assert_env_ok", "check_env", "get_env_class", "list_envs", "register"]
