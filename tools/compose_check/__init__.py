"""The compose check (scripts/compose-check.sh): compose.yaml run for real on a private
Docker engine, the image built from the project's Dockerfile, requests through the gateway
and NATS checked against a single-instance reference, and everything removed again.
``engine``: the private dockerd; ``prepare``: base image and wheels; ``check``: the run;
``otlp_sink``: the OTLP receiver that stands in for Jaeger."""
