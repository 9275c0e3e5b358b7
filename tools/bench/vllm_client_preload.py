"""What the bench's client processes fork from already holds (``client.run``): vLLM's CLI
and its ``bench serve``, prepared as ``vllm_cli`` prepares them and imported once, in the
forkserver. Each point's ``vllm bench serve`` is then a fresh process that starts sending
at once, not after importing vLLM anew (about 10 s a point on 2 cores)."""

from kvpush.tools.bench import vllm_cli

vllm_cli.prepare()

import vllm.entrypoints.cli.benchmark.serve  # noqa: E402,F401
import vllm.entrypoints.cli.main  # noqa: E402,F401
