# kda-serve on a CUDA GPU.
#   docker build -t kda-serve .
#   docker run --gpus all -p 8000:8000 kda-serve
# Settings come from KDA_* variables (see `kda-serve --help`).
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Triton compiles its kernel launcher at run time: it needs a C compiler and libc headers
# (the base image's Python already ships its own headers).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kda-serve

# Dependencies first, from pyproject.toml alone, so a code change does not reinstall them
# (torch and triton come with the base image and already satisfy the pins).
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY kernels ./kernels
COPY tensor_io ./tensor_io
COPY state_store ./state_store
COPY service ./service
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
