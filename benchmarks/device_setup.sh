# Sourced at the start of a device call (the lent H200 has no FlashInfer/pydantic/FastAPI/zmq): installs the
# wheels benchmarks/device_wheels.sh put in .whl (the call carries [".whl"]) and exports the environment the
# benchmarks expect. Usage on the device, from the project root:
#   source benchmarks/device_setup.sh <commit>
# Prints one line; a failed install stops the sourcing shell's next commands from running on a broken setup.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/tmp/pip_install.log 2>&1 || { tail -5 /tmp/pip_install.log; return 1; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1 AUTODEPLOY_COMMIT=${1:-$(git rev-parse --short HEAD 2>/dev/null)}
echo "device setup: $(ls .whl | wc -l) wheels, commit $AUTODEPLOY_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
