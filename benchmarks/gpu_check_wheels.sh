#!/bin/sh
# Here, before a lent GPU machine's call: the wheels its image lacks for the GPU check's server
# test (fastapi, uvicorn, openai and what they need; torch, triton and transformers are there),
# for its Python 3.12, into DIR (default .whl, which .git/info/exclude should name and the
# device call should carry). Then, there: sh benchmarks/gpu_check_device.sh
set -eu
dest=${1:-.whl}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
    uvicorn==0.54.0 h11==0.16.0 anyio==4.16.0 idna==3.20 sniffio==1.3.1 \
    openai==3.57.0 jiter==0.19.0 distro==1.9.0 httpx2==2.16.2 httpcore2==2.16.2 \
    truststore==0.10.5 opentelemetry-api==1.45.2 prometheus_client==0.26.0
ls "$dest"
