"""Print one of the README's two set-up commands, exactly as a newcomer would paste it.

    python3 .ci/readme_commands.py run     # the first: install corral and answer `corral run smollm2 "..."`
    python3 .ci/readme_commands.py test    # the second: install the test extras and run the suite

They are the bash code blocks of the README's "## Set up" section, in order. `.ci/run` executes what
this prints, so the README and CI cannot drift apart; tests/test_packaging.py checks their shape.
Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
NAMES = ("run", "test")


def setup_commands(text: str) -> list[str]:
    """The bash blocks of the "## Set up" section (each one command on one line)."""
    match = re.search(r"^## Set up\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise SystemExit("README.md has no '## Set up' section")
    blocks = re.findall(r"^```bash\n(.*?)^```", match.group(1), re.MULTILINE | re.DOTALL)
    return [block.strip() for block in blocks]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in NAMES:
        print(f"usage: readme_commands.py {{{'|'.join(NAMES)}}}", file=sys.stderr)
        return 2
    commands = setup_commands(README.read_text(encoding="utf-8"))
    if len(commands) != len(NAMES):
        print(f"README.md's Set up section has {len(commands)} commands, not {len(NAMES)}", file=sys.stderr)
        return 1
    print(commands[NAMES.index(argv[0])])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
