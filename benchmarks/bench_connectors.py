"""Same as ``vllm-kvbridge bench connectors ARGS``."""

import sys

from vllm_kvbridge.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "connectors", *sys.argv[1:]]))
