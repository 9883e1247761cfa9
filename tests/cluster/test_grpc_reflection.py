"""gRPC server reflection (what grpcurl uses) with grpc's own reflection client."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from loopserve.entrypoints.grpc.server import SERVICE
from tests.cluster.conftest import serving


def test_reflection_lists_and_describes_the_services(colocated_router):
    with serving(colocated_router) as client:
        db = ProtoReflectionDescriptorDatabase(client.channel)
        services = set(db.get_services())
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        service = db.FindFileContainingSymbol(SERVICE).service[0]
        assert [m.name for m in service.method] == ["Generate", "Abort", "Health", "GetStats"]
        assert service.method[0].server_streaming


def test_reflection_needs_the_token_too(colocated_router):
    with serving(colocated_router, auth_token="s3cret") as client:
        with pytest.raises(grpc.RpcError) as e:
            ProtoReflectionDescriptorDatabase(client.channel).get_services()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
