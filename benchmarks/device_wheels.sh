#!/usr/bin/env bash
# Wheels for a serving benchmark on the lent H200 (device tool), within the 64 MiB a call carries:
# ../shared/tools/gpu-wheels.sh --with-openai (FlashInfer, pydantic, transformers, FastAPI, uvicorn, the
# openai client), plus the serve extra's IPC libraries (pyzmq, msgspec) and py-spy (profiles); the
# transformers wheel is slimmed to the model families the benchmarks build (its other 500+ model
# folders are imported lazily by name, never by these runs). Usage, from the project root:
#   bash benchmarks/device_wheels.sh [PATH/TO/gpu-wheels.sh]
# A device call then carries [".whl"] and installs them as gpu-wheels.sh says.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
bash "${1:-../shared/tools/gpu-wheels.sh}" --with-openai >/dev/null
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl "pyzmq==27.3.0" "msgspec==0.22.0" "py-spy==0.4.3" 2>&1 | grep -v '^WARNING' || true
keep="auto llama llama4 gemma gpt2 qwen2 bert t5 deepseek_v2 deepseek_v3 deepseek_v32 glm4_moe_lite glm_moe_dsa \
      glm5_next minicpm3 mistral4 mistral_large4 kimi_linear longcat_flash youtu axk1 axk2"
tmp=$(mktemp -d)
whl=$(ls .whl/transformers-*.whl)
( cd "$tmp" && python3 -m zipfile -e "$top/$whl" . \
  && for d in transformers/models/*/; do n=$(basename "$d"); case " $keep " in *" $n "*) ;; *) rm -rf "$d";; esac; done \
  && python3 - "$top/$whl" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for root, _, files in os.walk("."):
        for f in files:
            p = os.path.join(root, f)
            z.write(p, os.path.relpath(p, "."))
PY
)
rm -rf "$tmp"
du -sh .whl
