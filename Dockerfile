# GPU image for cloud nodes: OpenRLHF 0.11.2 with vLLM, DeepSpeed and flash-attn, plus stare.
# The pinned versions below must equal pyproject.toml's `openrlhf` extra (a test compares them).
# Build: docker build -t stare:0.1.0 .      Run: docker run --gpus all --ipc=host stare:0.1.0 presets
FROM nvcr.io/nvidia/pytorch:26.03-py3

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1
# The base image ships its own torch build; vLLM 0.29.0 is built against torch 2.13.0, so take that one.
RUN pip uninstall -y torch torchvision torchaudio transformer-engine flash-attn || true
RUN pip install "torch==2.13.0" "vllm==0.29.0" "deepspeed==0.19.6" "ray[default]==2.55.0" "transformers==5.15.0"
RUN pip install --no-build-isolation "flash-attn==2.8.3"
RUN pip install "openrlhf==0.11.2"

WORKDIR /opt/stare
COPY pyproject.toml README.md ./
COPY stare_cli ./stare_cli
COPY algorithms ./algorithms
COPY eval ./eval
COPY configs ./configs
RUN pip install ".[lm-eval]"

ENTRYPOINT ["stare"]
CMD ["--help"]
