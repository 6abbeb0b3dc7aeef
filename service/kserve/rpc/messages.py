"""The KServe v2 gRPC messages and service: the modules tritonclient generates from the
official ``grpc_service.proto`` and ``model_config.proto`` (package ``inference``) and ships
in ``tritonclient.grpc``. One import point, so no other module names where they come from.
"""
from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as config_pb
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

__all__ = ["config_pb", "pb", "pb_grpc"]
