"""The gRPC forms of what the server and its model are (`service.kserve.model`) and of the
shared memory registry's status: ServerMetadata, ModelMetadata, ModelConfig and the shared
memory status responses."""
from __future__ import annotations

from state_store import PoolGeometry

from ...shm.registry import CUDA, SYSTEM, ShmRegistry
from ..model import MODEL, PLATFORM, VERSION, TensorInfo, model_inputs, model_outputs
from .messages import config_pb, pb


def _tensor(t: TensorInfo) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)


def model_metadata(geometry: PoolGeometry) -> pb.ModelMetadataResponse:
    """Model ``kda``: -1 marks the token dimension (and q/k's heads H)."""
    return pb.ModelMetadataResponse(name=MODEL, versions=[VERSION], platform=PLATFORM,
                                    inputs=[_tensor(t) for t in model_inputs(geometry)],
                                    outputs=[_tensor(t) for t in model_outputs(geometry)])


def model_config(geometry: PoolGeometry) -> pb.ModelConfigResponse:
    """Triton's ``ModelConfig`` of ``kda``: no batch dimension (one request is one
    sequence; the server merges requests into launches itself), a sequence batcher (the
    sequence parameters), the optional gate inputs marked optional."""
    def data_type(t: TensorInfo) -> int:
        return config_pb.DataType.Value(f"TYPE_{t.datatype}")

    config = config_pb.ModelConfig(
        name=MODEL, platform=PLATFORM, max_batch_size=0,
        input=[config_pb.ModelInput(name=t.name, data_type=data_type(t), dims=t.shape, optional=t.optional)
               for t in model_inputs(geometry)],
        output=[config_pb.ModelOutput(name=t.name, data_type=data_type(t), dims=t.shape)
                for t in model_outputs(geometry)],
        sequence_batching=config_pb.ModelSequenceBatching(),
    )
    return pb.ModelConfigResponse(config=config)


def system_status(registry: ShmRegistry, name: str) -> pb.SystemSharedMemoryStatusResponse:
    """Region ``name``, or every system region when ``name`` is empty."""
    response = pb.SystemSharedMemoryStatusResponse()
    for region in registry.status(SYSTEM, name or None):
        response.regions[str(region["name"])].CopyFrom(
            pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
    return response


def cuda_status(registry: ShmRegistry, name: str) -> pb.CudaSharedMemoryStatusResponse:
    """Region ``name``, or every CUDA region when ``name`` is empty."""
    registry.require_cuda()
    response = pb.CudaSharedMemoryStatusResponse()
    for region in registry.status(CUDA, name or None):
        response.regions[str(region["name"])].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(**region))
    return response
