"""Registry of eviction policies keyed by name: ``make_policy("h2o", budget=0.25)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

POLICIES: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: makes a policy frozen-dataclass and available under ``name``."""

    def wrap(cls: type) -> type:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclasses.dataclass(frozen=True)(cls)
        cls.name = name
        POLICIES[name] = cls
        return cls

    return wrap


def policy_params(name: str) -> dict[str, Any]:
    """The parameters a policy takes, with their defaults."""
    return {f.name: f.default for f in dataclasses.fields(get_policy_class(name))}


def get_policy_class(name: str) -> type:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


def make_policy(name: str, **params: Any):
    """The policy ``name`` with ``params``; PolicyParamError names an unknown parameter, or one of the wrong type
    or out of its declared range (``base.param``)."""
    from vtoken.core.policies.base import PolicyParamError

    cls = get_policy_class(name)
    known = {f.name for f in dataclasses.fields(cls)}
    for unknown in sorted(set(params) - known):
        raise PolicyParamError(name, unknown, f"policy {name!r} has no parameter {unknown!r}; it takes {sorted(known)}")
    return cls(**params)
