# One image for both deployments (registry.example.com/tandem in deploy/):
#   the scoring service   deploy/service/deployment.yaml   runs the CMD below (its `command` repeats it)
#   the Dagster code location and its run pods (deploy/dagster/values.yaml): the chart passes
#     `dagster api grpc -h 0.0.0.0 -p 3030 -m orchestration.definitions` as the container args, which
#     replace CMD. That is why there is no ENTRYPOINT: args would be appended to it.
#
#   docker build -t registry.example.com/tandem:0.1.0 \
#     --build-arg TANDEM_CODE_VERSION="$(git rev-parse --short=12 HEAD)" .
#
# tests/deploy/test_dockerfile.py checks that the CMD, port, working directory and user agree with
# the manifests.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU-only torch from PyTorch's own index, in a layer of its own (the largest, and it changes only
# with the pin): PyPI's default wheel pulls in the CUDA libraries, gigabytes this service never uses.
# `pip install .` below then finds the pyproject pin (torch==2.13.0) already satisfied.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /app
COPY . /app
# dagster-k8s: the run pods K8sRunLauncher starts from this image load the instance, whose run
# launcher is dagster_k8s's (same release line as dagster==1.13.27 in pyproject.toml).
RUN pip install . dagster-k8s==0.29.27

# Stamped on every result row (tandem/version.py); there is no git in the image. Unset: the package version.
ARG TANDEM_CODE_VERSION=""
ENV TANDEM_CODE_VERSION=${TANDEM_CODE_VERSION} \
    TANDEM_DATA_DIR=/var/lib/tandem \
    BENTOML_HOME=/var/lib/bentoml \
    HOME=/tmp

# The same uid/gid as the Deployment's securityContext (runAsUser/runAsGroup 10001). The state
# directories are volumes in Kubernetes; created here so `docker run` works without them.
RUN groupadd --gid 10001 tandem \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tandem \
    && mkdir -p /var/lib/tandem /var/lib/bentoml /opt/dagster/dagster_home \
    && chown -R 10001:10001 /var/lib/tandem /var/lib/bentoml /opt/dagster/dagster_home
USER 10001:10001

# 3001: the scoring service; 3030: the Dagster code location's gRPC server.
EXPOSE 3001 3030

CMD ["bentoml", "serve", "serving.service:TandemScorer", "--host", "0.0.0.0", "--port", "3001"]
