"""Eviction policies: where a token's life is decided. Importing this package registers them all."""

from vtoken.core.policies import h2o, random_policy, scissorhands, snapkv, streaming  # noqa: F401  (registration)
from vtoken.core.policies.base import ATTN_HIST, ATTN_SUM, EvictionPolicy, PolicyInput, PolicyParamError, param
from vtoken.core.policies.registry import POLICIES, get_policy_class, make_policy, policy_params, register

__all__ = [
    "ATTN_HIST",
    "ATTN_SUM",
    "EvictionPolicy",
    "PolicyInput",
    "PolicyParamError",
    "param",
    "POLICIES",
    "get_policy_class",
    "make_policy",
    "policy_params",
    "register",
]
