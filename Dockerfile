# The Steward image: one image for brokers (`steward broker ...`), workers (`steward worker ...`)
# and, in docker-compose.yml, the Spark worker (`spark-class ...`; the file says why).
#
#   docker build -t steward .
#   docker build -t steward --build-arg PYSPARK_VERSION=4.1.0 .   # match your Spark cluster
#
# No HEALTHCHECK here: what "healthy" means differs per role (a broker's /healthz, a worker
# registered with the leader, a Spark worker's UI), so each compose service declares its own.

# Debian 12 rather than the floating python:3.11-slim: Debian 13 ships no OpenJDK 17, and
# Java 17 is the runtime Spark 4 is built and released for.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the project as a wheel, so the final image carries no source tree -------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# Only what the wheel is built from (.dockerignore keeps the rest out of the context).
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY log ./log
COPY snapshot ./snapshot
COPY clients ./clients
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- the image ------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}

# The driver (a Steward worker's SparkSession) and the Spark cluster must run the same Spark
# version: they exchange serialized classes and RPC messages that are not compatible across
# versions. docker-compose.yml passes the version of its Spark image here.
ARG PYSPARK_VERSION=4.1.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A headless JRE is all Spark needs at run time (no compiler, no X11 libraries). The man1
# directory is missing in slim images and the OpenJDK packages' postinst links into it.
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless libnss-wrapper; \
    rm -rf /var/lib/apt/lists/*

# pyspark alone is most of the image (its jars): its own layer, so rebuilding after a code
# change reuses it.
RUN pip install "pyspark==${PYSPARK_VERSION}"

# The project and its dependencies, no test extras; pyspark stays pinned to the version above.
COPY --from=build /wheels /tmp/wheels
RUN pip install /tmp/wheels/*.whl "pyspark==${PYSPARK_VERSION}" && rm -rf /tmp/wheels

# Not root: nothing here needs it. The data and cache directories exist in the image, owned
# by steward, so named volumes mounted on them start out writable by it.
RUN set -eux; \
    useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/steward \
        --shell /usr/sbin/nologin steward; \
    install -d -o steward -g steward /var/lib/steward/data /var/lib/steward/cache
USER steward
WORKDIR /var/lib/steward

# Documentation only: the broker's HTTP API and its worker endpoint (compose picks its own).
EXPOSE 8080 7070

ENTRYPOINT ["steward"]
CMD ["--help"]
