#!/usr/bin/env bash
# Puts what bench/gpu_check.py needs on a GPU machine that has no package registry and receives
# only the repository into git-ignored folders inside it, to be copied along with it:
#   .gsm8k/  GSM8K's train.jsonl and test.jsonl, the step parts' prompts (from $GSM8K_DIR, default
#            ../shared/gsm8k beside the repository), and COMMIT, the commit the results come from
#   .whl/    wheels (CPython $WHEEL_PYTHON, default 3.12, x86-64 Linux, no dependencies) of the
#            packages named as arguments: whatever the parts import that the machine lacks
# Usage: bench/device_prep.sh [NAME==VERSION ...]
# Run it here, then on the GPU machine the command in docs/performance.md, "Measuring on a GPU".
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src=${GSM8K_DIR:-$root/../shared/gsm8k}
py=${WHEEL_PYTHON:-3.12}

for split in train test; do
    if [ ! -f "$src/$split.jsonl" ]; then
        echo "device_prep.sh: no $src/$split.jsonl (set GSM8K_DIR to a folder with GSM8K's train.jsonl" \
             "and test.jsonl)" >&2
        exit 1
    fi
done
mkdir -p "$root/.gsm8k" "$root/.whl"
cp "$src/train.jsonl" "$src/test.jsonl" "$root/.gsm8k/"
# the commit, for results taken where the copy has no .git (bench/gpu_check.py records it); a
# working tree that differs from it says so
dirty=$(cd "$root" && git status --porcelain --untracked-files=no | head -n 1)
echo "$(cd "$root" && git rev-parse --short HEAD)${dirty:+ with uncommitted changes}" > "$root/.gsm8k/COMMIT"
echo "GSM8K: $(wc -l < "$root/.gsm8k/train.jsonl") train and $(wc -l < "$root/.gsm8k/test.jsonl") test rows in .gsm8k/"

if [ "$#" -gt 0 ]; then
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        --platform any -d "$root/.whl" "$@"
fi
echo "wheels in .whl/: $(find "$root/.whl" -type f -name '*.whl' | wc -l)"

# what travels: the repository's files that git does not ignore, plus the two folders
cd "$root"
kib=$(git ls-files -co --exclude-standard -z | du -c -k --files0-from=- | tail -n 1 | cut -f 1)
extra=$(du -s -k .gsm8k .whl | awk '{s += $1} END {print s}')
echo "to copy: repository $((kib / 1024)) MiB + .gsm8k and .whl $((extra / 1024)) MiB"
