#!/usr/bin/env bash
# Builds .venvs/qwen-tts: the authors' `qwen-tts` package, the parity reference for the qwen3_tts family.
# It pins transformers 4.57.3, which omnistage's venv cannot share, so it lives in a venv of its own.
# Idempotent: a venv whose marker file exists is left as it is.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${QWEN_TTS_VENV:-$root/.venvs/qwen-tts}"
marker="$venv/.omnistage-ready"
[[ -f "$marker" ]] && exit 0
python3 -m venv "$venv"
pip="$venv/bin/pip"
# qwen_tts imports torchaudio at import time (its 25 Hz tokenizer), and torchaudio's C extension loads only
# against the torch it was built for: install the pair together. The reference runs on the CPU only.
"$pip" install -q torch==2.11.0 torchaudio==2.11.0
# qwen-tts's own pins (transformers 4.57.3, accelerate 1.12.0) resolve against that torch.
"$pip" install -q qwen-tts==0.1.1
"$venv/bin/python" -c "import qwen_tts, torch, transformers; print(torch.__version__, transformers.__version__)"
touch "$marker"
