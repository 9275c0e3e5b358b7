"""kvpush's OpenTelemetry: attribute names (``attributes``), provider setup (``setup``),
trace context at the NATS boundary (``messaging``), metrics (``metrics``), the local
OTLP-JSON span files (``files``) and the terminal trace view (``view``)."""
