#!/usr/bin/env bash
# What a GPU session (scripts/gpu_session.sh) carries to the device machine, rebuilt here:
# .whl/ holds the wheels the machine's image lacks, at the versions .venv has, and .gpu_cache/
# SmolLM2's tokenizer (which the random-weight Qwen2.5-7B uses; the GGUF stays here). Both are
# ignored by git through .git/info/exclude, and the device tool's `carry` names them.
#
#   bash scripts/gpu_carry.sh        # then: carry [".whl", ".gpu_cache"]
set -eu
cd "$(dirname "$0")/.."
# The server's stack and DuckDB; everything else the book needs is in the image (the device
# tool's KINDS.md lists it). fastapi >= 0.165 imports opentelemetry-api.
need="duckdb fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
opentelemetry-api"
pins=$(.venv/bin/python - $need <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PY
)
rm -rf .whl && mkdir -p .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
mkdir -p .gpu_cache/smollm2-135m
cache=${MINIINFER_CACHE:-$HOME/.cache/miniinfer}/smollm2-135m
cp "$cache"/tokenizer.json "$cache"/tokenizer_config.json "$cache"/chat_template.jinja \
    .gpu_cache/smollm2-135m/
for path in /.whl/ /.gpu_cache/; do
    grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude
done
du -sh .whl .gpu_cache
