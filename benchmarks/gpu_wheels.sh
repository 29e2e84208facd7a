#!/usr/bin/env bash
# Wheels a bare GPU machine needs beside its own torch/triton/numpy image to run omnistage's benchmarks and GPU
# tests (the serving stack, media, transformers at the version omnistage reads), downloaded into DIR (default
# .whl) at the versions the local environment has: python3 -m pip install --no-index --no-deps --target
# /tmp/site DIR/*.whl there, then PYTHONPATH=/tmp/site:$PWD. For Python 3.12 on x86-64 Linux.
#     benchmarks/gpu_wheels.sh [DIR] [PYTHON]     # PYTHON: the environment whose versions to fetch
# WITH_RAY=1 adds Ray and what it needs beyond a typical CUDA image (for tests/runtime/test_ray_backend.py; Ray's
# wheel alone is ~80 MB).
set -euo pipefail
dir=${1:-.whl}
python=${2:-python3}
names=(transformers huggingface-hub hf-xet tokenizers kernels tomlkit regex fastapi starlette opentelemetry-api uvicorn pydantic pydantic_core annotated-types
       typing-inspection msgspec pyzmq openai httpx2 httpcore2 truststore jiter sniffio soundfile cffi pycparser
       soxr av pytest-asyncio python-multipart xgrammar apache-tvm-ffi diffusers peft accelerate psutil cache-dit torchao
       ftfy wcwidth torchsde trampoline)  # the last line: Wan's prompt cleaning, Stable Audio's SDE scheduler
if [[ ${WITH_RAY:-0} == 1 ]]; then
  names+=(ray jsonschema jsonschema-specifications referencing rpds-py)
fi
mkdir -p "$dir"
for name in "${names[@]}"; do
  version=$("$python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$name${version:+==$version}"
done
ls "$dir"
