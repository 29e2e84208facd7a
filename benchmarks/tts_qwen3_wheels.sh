#!/usr/bin/env bash
# Wheels for benchmarks/tts_qwen3.py on a bare GPU machine (its image has torch, torchaudio, transformers 5.17,
# huggingface-hub 1.x, tokenizers 0.23, accelerate, scipy, numba, scikit-learn, einops, onnxruntime, ...), in two
# sets under DIR (default .whl-tts), for Python 3.12 on x86-64 Linux:
#   DIR/omni  what omnistage's AsyncOmni imports for qwen3_tts beyond that image, at the versions PYTHON has
#             (transformers >= 5.24 wants huggingface-hub 2.x, which brings httpx2); no server, diffusion or media
#             stack. Install: pip install --no-index --no-deps --target /tmp/omni DIR/omni/*.whl;
#             run with PYTHONPATH=/tmp/omni:$PWD.
#   DIR/ref   the authors' qwen-tts 0.1.1 with transformers 4.57.3 and what that pins below the image's versions
#             (huggingface-hub < 1, tokenizers <= 0.23.0, qwen-tts's accelerate), plus what qwen_tts imports at
#             import time that the image lacks (librosa and its audio readers, soundfile, soxr, sox). Install it
#             into its own --target and pass that as --reference-site (prepended to the subprocess's PYTHONPATH).
#     benchmarks/tts_qwen3_wheels.sh [DIR] [PYTHON]
set -euo pipefail
dir=${1:-.whl-tts}
python=${2:-python3}
omni=(transformers huggingface-hub hf-xet kernels tomlkit regex httpx2 httpcore2 truststore sniffio pydantic pydantic_core
      annotated-types typing-inspection msgspec pyzmq soundfile cffi pycparser soxr)
ref=(transformers==4.57.3 "huggingface-hub>=0.34,<1.0" "tokenizers>=0.22,<=0.23.0" accelerate==1.12.0 qwen-tts==0.1.1
     librosa audioread decorator pooch platformdirs soundfile cffi pycparser soxr sox)
fetch() {  # fetch DEST SPEC...
  local dest=$1
  shift
  mkdir -p "$dest"
  for spec in "$@"; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "$spec"
  done
}
specs=()
for name in "${omni[@]}"; do
  version=$("$python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  specs+=("$name${version:+==$version}")
done
fetch "$dir/omni" "${specs[@]}"
fetch "$dir/ref" "${ref[@]}"
du -sh "$dir/omni" "$dir/ref"
ls "$dir/omni" "$dir/ref"
