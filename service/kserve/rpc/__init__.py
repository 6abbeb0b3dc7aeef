"""The Open Inference Protocol (KServe v2) over gRPC: ``GRPCInferenceService`` on grpc.aio,
with the official messages (`messages`: tritonclient's modules generated from
``grpc_service.proto``), so ``tritonclient.grpc`` works unchanged.

A front end of `service.kserve.endpoint.KServeEndpoint`, as the HTTP routes are: the same
inputs, outputs, parameters, sequences, validation and batching, and bit-identical
results. Modules: `server` (`GrpcFrontEnd`: listen, drain, stop), `servicer` (one method
per RPC), `calls` (API key, status codes, metrics, whole requests), `status` (errors ->
status codes), `decode` (requests that are not valid messages), `codec`
(ModelInferRequest/Response <-> the neutral request), `metadata` (metadata, config and
shared memory status messages), `stream` (ModelStreamInfer).
Needs the ``grpc`` extra (grpcio, tritonclient[grpc]).
"""
from .server import GrpcFrontEnd

__all__ = ["GrpcFrontEnd"]
