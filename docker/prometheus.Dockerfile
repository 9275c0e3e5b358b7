# The compose check's stand-in for prom/prometheus (no registry here): Debian's package,
# started the way the official image starts it (compose.yaml passes --config.file).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/*
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]
