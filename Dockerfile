# GPU image for cloud nodes: OpenRLHF (pinned below) with vLLM, DeepSpeed and flash-attn, plus stare.
# The pinned versions below must equal pyproject.toml's `openrlhf` extra (a test compares them); `hadolint
# --failure-threshold warning Dockerfile` must pass (a test runs it).
# Build: docker build -t stare:0.1.0 .      Run: docker run --gpus all --ipc=host stare:0.1.0 presets
# flash-attn 2.8.3 has no wheel for torch 2.13 and compiles from source (see the README's Docker section for how
# long that takes and how to reuse a built wheel): FLASH_ATTN_CUDA_ARCHS picks the GPU generations (80 Ampere,
# 90 Hopper, 100 and 120 Blackwell), MAX_JOBS the parallel compile jobs (each can take several GB of RAM).
FROM nvcr.io/nvidia/pytorch:26.03-py3

ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=8

# PIP_CONSTRAINT: NGC PyTorch images since 25.03 pin their own package versions (/etc/pip/constraint.txt),
# which would refuse the torch this image needs; no pip cache kept in the layers.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1 PIP_CONSTRAINT="" \
    PIP_NO_CACHE_DIR=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The base image ships its own torch build; vLLM 0.29.0 is built against torch 2.13.0, so take that one. Also
# removed (as OpenRLHF's own image does): packages of the base image that conflict with vLLM / DeepSpeed's
# requirements or their own CUDA builds. pip uninstall skips (exit 0) a package that is absent, and fails on a
# real error, which stops the build.
# triton: the one torch 2.13.0 pins (its Requires-Dist), named here because CI compiles stare's Triton kernel for
# sm_80 and sm_90 with the test extra's triton, which must be this one (a test compares them).
# packaging, wheel, ninja, psutil: what flash-attn 2.8.3's setup.py needs from this environment under
# --no-build-isolation (below): it imports packaging and wheel.bdist_wheel, lists packaging, psutil and ninja as
# setup_requires, imports psutil when MAX_JOBS is unset, and without the ninja binary torch falls back to a serial
# build. (setuptools, which torch requires, also carries packaging and wheel; these pins do not rely on that.)
RUN pip uninstall -y torch torchvision torchaudio transformer-engine flash-attn \
        xgboost torchao pynvml opencv-python-headless \
    && pip install --no-cache-dir "torch==2.13.0" "triton==3.7.1" "vllm==0.29.0" "deepspeed==0.19.6" \
        "ray[default]==2.55.0" "transformers==5.15.0" \
        "packaging==26.4" "wheel==0.48.0" "ninja==1.13.2" "psutil==7.2.2"

# flash-attn: a wheel found in the build context's docker-wheels/ (from an earlier build of this image) is
# installed as is; otherwise it is built here and kept in /opt/wheels (copy it out with `docker cp`).
COPY docker-wheels/ /tmp/docker-wheels/
RUN mkdir -p /opt/wheels \
    && if compgen -G "/tmp/docker-wheels/flash_attn-2.8.3-*.whl" > /dev/null; then \
        cp /tmp/docker-wheels/flash_attn-2.8.3-*.whl /opt/wheels/; \
    else \
        FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
            pip wheel --no-cache-dir --no-deps --no-build-isolation -w /opt/wheels "flash-attn==2.8.3"; \
    fi \
    && pip install --no-cache-dir --no-deps /opt/wheels/flash_attn-2.8.3-*.whl \
    && rm -rf /tmp/docker-wheels \
    && pip install --no-cache-dir "openrlhf==0.11.2"

WORKDIR /opt/stare
COPY pyproject.toml README.md ./
COPY stare_cli ./stare_cli
COPY algorithms ./algorithms
COPY eval ./eval
COPY configs ./configs
RUN pip install --no-cache-dir "./[lm-eval]"
# read by stare's hints: in this image the GPU stack is installed, so a missing piece means a broken build
ENV STARE_IMAGE=1

ENTRYPOINT ["stare"]
CMD ["--help"]
