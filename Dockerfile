# kthrottle in a container: `docker build -t kthrottle .`, then
#   docker run -p 9192-9202:9192-9202 -p 9300:9300 kthrottle \
#     --upstream broker:9092 --listen 0.0.0.0:9192 --advertised-host <host clients reach> --metrics-port 9300
# An upstream is required here: the embedded local cluster of a bare `kthrottle run` needs a JDK and
# Maven, which this image does not carry.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what `pip install .` needs (pyproject's packages and its readme); .dockerignore keeps the rest out.
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY quotas ./quotas
COPY config ./config
COPY proxy ./proxy
COPY cli ./cli
COPY top ./top
COPY harness ./harness
COPY reports ./reports
RUN pip install . && rm -rf /src

RUN useradd --system --uid 10001 --no-create-home kthrottle
USER kthrottle
WORKDIR /

# Bootstrap listener, then broker node N on listen port + 1 + N (nodes 0..9 here), then metrics.
EXPOSE 9192 9193-9202 9300

# Exec form: kthrottle is PID 1 and gets SIGTERM (clean stop) and SIGHUP (reload the quota file).
ENTRYPOINT ["kthrottle", "run"]
