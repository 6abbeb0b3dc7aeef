# kda-serve on a CUDA GPU.
#   docker build -t kda-serve .
#   docker build --build-arg EXTRAS=grpc,ray -t kda-serve .     # with the gRPC endpoint and Ray Serve
#   docker run --gpus all -p 8000:8000 kda-serve
# Settings come from KDA_* variables (see `kda-serve --help`).
# The base carries torch 2.11, triton 3.6 and CUDA 13.0: the stack the GPU tests ran on (the H200).
# Every other dependency is installed at the version CI tested (constraints.txt).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Triton compiles its kernel launcher at run time: it needs a C compiler and libc headers
# (the base image's Python already ships its own headers).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kda-serve

# Dependencies first, from pyproject.toml alone (with the extras in EXTRAS, comma-separated:
# grpc, ray), so a code change does not reinstall them (torch and triton come with the base
# image and already satisfy the pins).
ARG EXTRAS=""
COPY pyproject.toml constraints.txt ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = [e for e in os.environ['EXTRAS'].split(',') if e]; \
print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY kernels ./kernels
COPY tensor_io ./tensor_io
COPY state_store ./state_store
COPY service ./service
COPY kda_client ./kda_client
RUN pip install --no-cache-dir --no-deps .

RUN useradd --create-home --uid 10001 kda \
    && mkdir -p /var/lib/kda-serve \
    && chown kda:kda /var/lib/kda-serve
USER 10001
ENV KDA_HOST=0.0.0.0 \
    KDA_PORT=8000 \
    KDA_DEVICE=auto \
    TRITON_CACHE_DIR=/home/kda/.triton \
    PYTHONUNBUFFERED=1
EXPOSE 8000
VOLUME ["/var/lib/kda-serve"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "service.http.healthcheck"]
ENTRYPOINT ["kda-serve"]
