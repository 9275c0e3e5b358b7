"""The services' settings, one table: flag, environment variable, default, help.

A flag's default is its environment variable when set, else the value in
``kvpush.shared.settings``; compose configures the services through these variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from kvpush.shared import connector_kinds
from kvpush.shared import settings as defaults


@dataclass(frozen=True)
class Setting:
    flag: str
    env: str
    default: Any
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] = field(default=())

    def add_to(self, parser, default: Any = ...) -> None:
        """Add the flag to an argparse parser; a given ``default`` replaces both the
        environment variable and the table's default."""
        if default is ...:
            value = os.environ.get(self.env)
            default = self.type(value) if value is not None else self.default
        chosen = default
        parser.add_argument(self.flag, type=self.type, default=chosen, choices=self.choices or None, help=self.help)


_FAULTS = defaults.FAULTS

SETTINGS: dict[str, Setting] = {s.flag: s for s in [
    Setting("--nats-url", "KVPUSH_NATS_URL", defaults.DEFAULT_NATS_URL,
            "NATS server URL, or several members of one cluster separated by commas"),
    Setting("--model", "KVPUSH_MODEL", None,
            "a local Hugging Face model folder (default: the built-in small model)"),
    Setting("--max-model-len", "KVPUSH_MAX_MODEL_LEN", defaults.MAX_MODEL_LEN,
            "context length the engines serve", int),
    Setting("--log-level", "KVPUSH_LOG_LEVEL", "INFO", "log level of the services"),
    Setting("--metrics-port", "KVPUSH_METRICS_PORT", None,
            "serve Prometheus /metrics and /health on 127.0.0.1 here (KVPUSH_METRICS_HOST to change); "
            "a worker's engine core uses the next port", int),
    Setting("--metrics-host", "KVPUSH_METRICS_HOST", "127.0.0.1",
            "the address /metrics listens on (0.0.0.0 in a container)"),
    Setting("--mode", "KVPUSH_MODE", defaults.TRANSFER_MODE,
            "how a request is served unless it says otherwise (transfer_mode): its KV pushed or pulled, or "
            "auto: per request, from live load (local prefill, push or pull)", str, ("push", "pull", "auto")),
    Setting("--kv-policy", "KVPUSH_KV_POLICY", defaults.KV_POLICY,
            "a request whose prompt's KV did not arrive intact (a failed transfer): decode computes the prompt "
            "itself (recompute), or the request ends with kv_transfer_failed (fail); unless it says (kv_policy). "
            "A decode worker run with --on-kv-failure fail fails such requests whatever they say",
            str, ("recompute", "fail")),
    Setting("--kv-checksums", "KVPUSH_KV_CHECKSUMS", defaults.KV_CHECKSUMS,
            "end-to-end checksums of transferred KV: prefill sends a checksum of the blocks, decode checks what "
            f"landed before the request runs (a mismatch is a failed transfer: kv_policy applies); for every "
            f"transfer (full), {defaults.KV_CHECKSUM_FRACTION:g} of them (sampled), or none (off)",
            str, ("off", "sampled", "full")),
    Setting("--max-migrations", "KVPUSH_MAX_MIGRATIONS", defaults.MAX_MIGRATIONS,
            "times a request whose decode was lost (or stalled) after tokens went out continues on another "
            "decode, after the last token its client has; past it the request ends with worker_lost", int),
    Setting("--stall-s", "KVPUSH_STALL_S", defaults.STALL_S,
            "a decode streaming a request, its worker still heartbeating, without a token for this long has "
            "stalled: the request continues on another decode (0: never)", float),
    Setting("--prefix-fetch", "KVPUSH_PREFIX_FETCH", defaults.PREFIX_FETCH,
            "a prompt's longest cached prefix, held by another engine than the one computing it, is READ from "
            "that engine's cache (it lends the blocks under a lease) when that should be faster than computing it "
            "(on), or always computed again (off)", str, ("on", "off")),
    Setting("--fetch-link-gbps", "KVPUSH_FETCH_LINK_GBPS", defaults.FETCH_LINK_BYTES_PER_S * 8 / 1e9,
            "--prefix-fetch: the rate NIXL moves KV between engines at, Gbit/s (the default: the low end measured "
            "between two engines on one host here); with a prefill's measured prompt rate and the holder's queue, "
            "it decides whether a held prefix is fetched or computed again", float),
    Setting("--local-below-tokens", "KVPUSH_LOCAL_BELOW_TOKENS", defaults.LOCAL_PREFILL_TOKENS,
            "--mode auto: prompts shorter than this are computed by their decode worker", int),
    Setting("--push-within-s", "KVPUSH_PUSH_WITHIN_S", defaults.PUSH_WITHIN_S,
            "--mode auto: push when prefill should end within this, else pull", float),
    Setting("--connector", "KVPUSH_CONNECTOR", defaults.CONNECTOR,
            "KV connector of the engines: ours, or vLLM's NixlConnector (pull) or NixlPushConnector, "
            "for side-by-side comparison", str, connector_kinds.NAMES),
    Setting("--block-size", "KVPUSH_BLOCK_SIZE", 0,
            "tokens per KV cache block (vLLM's --block-size); 0: vLLM's default, 16 on GPUs and 128 on its CPU "
            "platform, whose attention takes only multiples of 32. Smaller blocks: more descriptors per transfer",
            int),
    Setting("--max-num-seqs", "KVPUSH_MAX_NUM_SEQS", 16,
            "requests the engine runs at once (vLLM's --max-num-seqs; vllm serve's default is 128 on CPUs, 256-1024 "
            "on GPUs); more wait in its queue", int),
    Setting("--tensor-parallel-size", "KVPUSH_TENSOR_PARALLEL_SIZE", 1,
            "worker: the engine's tensor parallelism, one process per rank (vLLM's --tensor-parallel-size); "
            "on CPUs above 1, each rank gets its own cores unless VLLM_CPU_OMP_THREADS_BIND says where "
            "(docs/tensor-parallel.md)",
            int),
    Setting("--prefix-caching", "KVPUSH_PREFIX_CACHING", defaults.PREFIX_CACHING,
            "the engines' prefix caching: a prompt's cached prefix is neither computed nor transferred again",
            str, ("on", "off")),
    Setting("--json-whitespace", "KVPUSH_JSON_WHITESPACE", defaults.JSON_WHITESPACE,
            "decode: whitespace a JSON answer (response_format, structured_outputs) may have between tokens: any "
            "(vLLM's default) or none (vLLM's disable_any_whitespace; this vLLM reads it per engine, not per request)",
            str, ("any", "none")),
    Setting("--push-by-layer", "KVPUSH_PUSH_BY_LAYER", defaults.PUSH_BY_LAYER,
            "prefill: write each layer's KV to decode as soon as the forward has computed it, so later "
            "layers compute while earlier ones travel (else one WRITE after the last layer); auto: on for engines on "
            "GPUs, off on CPUs", str, ("on", "off", "auto")),
    Setting("--deadline-s", "KVPUSH_DEADLINE_S", defaults.DEADLINE_S,
            "every accepted request gets a final message (an answer or an error) within this", float),
    Setting("--worker-timeout-s", "KVPUSH_WORKER_TIMEOUT_S", defaults.WORKER_TIMEOUT_S,
            "a worker without a heartbeat for this long is lost; its requests are retried", float),
    Setting("--max-in-flight", "KVPUSH_MAX_IN_FLIGHT", defaults.MAX_IN_FLIGHT,
            "requests one scheduler holds at once; past it, new requests get `overloaded`", int),
    Setting("--scheduler-timeout-s", "KVPUSH_SCHEDULER_TIMEOUT_S", defaults.SCHEDULER_TIMEOUT_S,
            "a scheduler without a heartbeat for this long is lost; another takes its requests over", float),
    Setting("--jetstream-replicas", "KVPUSH_JETSTREAM_REPLICAS", 1,
            "replicas of the flights, claims and finals buckets (3 on a NATS cluster)", int),
    Setting("--lease-s", "KVPUSH_LEASE_S", _FAULTS.lease_s,
            "prefill: keep a finished prompt's blocks this long unless decode renews the lease", float),
    Setting("--kv-wait-s", "KVPUSH_KV_WAIT_S", _FAULTS.kv_wait_s,
            "decode: give registered blocks up after this long without the KV", float),
    Setting("--quarantine-s", "KVPUSH_QUARANTINE_S", _FAULTS.quarantine_s,
            "decode: after giving blocks up, keep them this long unless prefill answers", float),
    Setting("--on-kv-failure", "KVPUSH_ON_KV_FAILURE", _FAULTS.on_kv_failure,
            "decode: the strictest kv_policy it applies: with fail, a request whose KV did not arrive intact "
            "fails even if it asked for recompute (recompute: each request's own policy)",
            str, ("recompute", "fail")),
    Setting("--api-key", "KVPUSH_API_KEY", None,
            "gateway: /v1 requests need 'Authorization: Bearer <this key>' (as vllm serve --api-key); "
            "all its users are one kvpush client (on the command line it shows in the process list: prefer the variable)"),
    Setting("--api-keys-file", "KVPUSH_API_KEYS_FILE", None,
            "gateway: a TOML file of API keys, one tenant each, with its own NATS user and limits "
            "(services/gateway/keys.py)"),
    Setting("--max-concurrent-per-key", "KVPUSH_MAX_CONCURRENT_PER_KEY", 0,
            "gateway: requests one API key may have in progress; past it, 429 (0: no limit)", int),
    Setting("--rate-per-key", "KVPUSH_RATE_PER_KEY", 0.0,
            "gateway: requests per second one API key may start, on average; past it, 429 (0: no limit)", float),
    Setting("--burst-per-key", "KVPUSH_BURST_PER_KEY", 0,
            "gateway: requests one API key may start at once above --rate-per-key (0: the rate, at least 1)", int),
]}

# Environment variables kvpush reads, each the default of an option or a setting.
ENVIRONMENT = {
    **{s.env: f"{s.help} ({s.flag})" for s in SETTINGS.values()},
    "KVPUSH_CACHE_DIR": "where built models and local traces go (default ~/.cache/kvpush)",
    "KVPUSH_TRACE_DIR": "where local OTLP-JSON span files go (default <cache>/traces)",
    "KVPUSH_NATS_USER / _PASSWORD / _TOKEN / _NKEY_SEED / _CREDS": "NATS login (--nats-user ...); see deploy/README.md",
    "KVPUSH_NATS_TLS_CA / _TLS_CERT / _TLS_KEY": "NATS TLS: the CA to trust, the client certificate and key",
    "KVPUSH_ADVERTISE_HOST": "the address other hosts reach this worker at, for vLLM's NIXL side channel "
                             "(--connector vllm-nixl*; default 127.0.0.1); kvpush's connector needs none",
    "UCX_TLS / UCX_NET_DEVICES": "UCX's own: which transports and interfaces carry the KV (docs/multi-host.md)",
}
OTEL_ENVIRONMENT = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "send spans and metrics there (OTLP/HTTP) instead of local files",
    "OTEL_METRICS_EXPORTER": "'none' turns metric export off (e.g. for a traces-only backend)",
    "OTEL_METRIC_EXPORT_INTERVAL": "metric export interval in ms",
    "OTEL_SERVICE_NAME": "overrides the service name of one process",
}


def add(parser, *flags: str, **defaults_by_flag: Any) -> None:
    """Add these settings' flags to ``parser`` (``nats_url=None`` overrides a default)."""
    for flag in flags:
        key = flag.lstrip("-").replace("-", "_")
        SETTINGS[flag].add_to(parser, defaults_by_flag.get(key, ...))
