#!/usr/bin/env bash
# On the GPU machine, before run_h200.sh: rebuilds onnxruntime-gpu and the carried wheels into
# /tmp/site from the chunks in /tmp/ortgpu, and the float16 model into /tmp/model from the parts
# of its tar.xz in /tmp/gpumodel. Prints the providers ONNX Runtime offers.
# usage: source benchmarks/gpu/prepare.sh
python3 /tmp/ortgpu/unpack.py /tmp/ortgpu /tmp/site || return 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/model && cat /tmp/gpumodel/part.* | xz -d | tar -x -C /tmp/model --strip-components 1 || return 1
ls -la /tmp/model
# CUDA's libraries come from the machine's nvidia-* packages.
nvidia_root=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null)
if [ -n "$nvidia_root" ]; then
  LD_LIBRARY_PATH=$(find "$nvidia_root/nvidia" -maxdepth 3 -type d -name lib | paste -sd:):${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH
fi
