"""`python -m corral.server`: the server alone, as `corral serve` runs it.

`corral serve` replaces its own process with this one (exec), so the process that serves holds only
what serving needs: not the command line's HTTP client and terminal output, nor torch (runner
processes compute; tests/test_server_footprint.py holds the server under 80 MB).
"""

import trio

from corral.address import address_from_env
from corral.logs import setup_logging
from corral.server.serve import serve_until_signalled


def main() -> None:
    setup_logging()  # logfmt on stderr (CORRAL_LOG_FORMAT=json for JSON lines), DEBUG with CORRAL_DEBUG=1
    _, host, port = address_from_env()
    trio.run(serve_until_signalled, host, port)


if __name__ == "__main__":
    main()
