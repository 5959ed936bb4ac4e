"""Print the README's shell command number N (1-based) of its "Demo and tests" section, as
written, for .ci/run: CI runs exactly what the README tells a user to type."""
import pathlib
import re
import sys

SECTION = "## Demo and tests"


def commands() -> list[str]:
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", section, re.S)]


if __name__ == "__main__":
    print(commands()[int(sys.argv[1]) - 1])
