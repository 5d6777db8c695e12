"""The gateway's bearer-token check: the scheme in any case, health checks open unless configured. No Ray."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "method, metadata, open_health, allowed",
    [
        ("/vtoken.v1.VToken/Generate", (("authorization", "Bearer s3cret"),), True, True),
        ("/vtoken.v1.VToken/Generate", (("authorization", "bearer s3cret"),), True, True),
        ("/vtoken.v1.VToken/Generate", (("authorization", "bEaReR  s3cret "),), True, True),
        ("/vtoken.v1.VToken/Generate", (("authorization", "Basic s3cret"),), True, False),
        ("/vtoken.v1.VToken/Generate", (("authorization", "Bearer s3cret2"),), True, False),
        ("/vtoken.v1.VToken/Generate", (), True, False),
        ("/grpc.health.v1.Health/Check", (), True, True),
        ("/grpc.health.v1.Health/Check", (), False, False),  # gateway.health_requires_auth: true
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", (), True, False),
    ],
)
def test_bearer_auth_scheme_in_any_case_and_open_health_checks(method, metadata, open_health, allowed):
    import asyncio
    from collections import namedtuple

    import grpc

    from cluster.doors.grpc_server import HEALTH_PREFIX, BearerAuth

    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details):
        return handler

    details = namedtuple("Details", "method invocation_metadata")(method, metadata)
    auth = BearerAuth("s3cret", (HEALTH_PREFIX,) if open_health else ())
    got = asyncio.run(auth.intercept_service(continuation, details))
    assert (got is handler) == allowed
